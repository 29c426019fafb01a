"""The GPU step's options, proven on CPU: AdamW's fused kernel against foreach (the same update
within float rounding), the chunked LM head + loss against the whole-batch one (loss and
gradients equal, the logits never whole), the compiled LM head + loss (one graph, the eager
loss), and their config checks. None changes the default."""

import pytest
import torch

from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.model import ReMoEConfig, ReMoEForCausalLM
from remoe.model.losses import chunked_lm_loss
from remoe.train.optim import adamw_kwargs, build_optimizer


def test_adamw_impl_keywords_and_the_default_is_unchanged():
    assert adamw_kwargs("auto", "cpu") == {"foreach": False, "fused": None}
    assert adamw_kwargs("auto", "cuda") == {"foreach": True, "fused": None}
    assert adamw_kwargs("fused", "cuda") == {"foreach": False, "fused": True}
    assert adamw_kwargs("single", "cuda") == {"foreach": False, "fused": None}
    assert load_config(None, []).train.adamw_impl == "auto"
    with pytest.raises(ConfigError, match="train.adamw_impl"):
        load_config(None, ["train.adamw_impl=apex"])


def _updated(impl):
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="relu"))
    tc = load_config(None, [f"train.adamw_impl={impl}", "train.lr=3e-3"]).train
    opt = build_optimizer(model, tc, "cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 512, (4, 17), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_gives_foreach_s_update():
    foreach, fused = _updated("foreach"), _updated("fused")
    worst = max(float((a - b).abs().max() / (a.abs().max() + 1e-12))
                for a, b in zip(foreach, fused))
    # measured 2.2e-6 (default kernels) and 2.4e-6 (avx2 + MKL_CBWR=COMPATIBLE) on an Intel Xeon:
    # float rounding of a differently fused update, three steps in
    assert worst < 2e-5, worst


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_loss_equals_the_whole_batch_loss(chunk):
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk"))
    ids = torch.randint(0, 512, (3, 21))
    labels = ids.clone()
    labels[0, 5:9] = -100  # ignored positions count as in F.cross_entropy
    whole = model(ids, labels=labels)
    whole.loss.backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, loss_chunk_tokens=chunk)
    assert out.logits is None
    out.loss.backward()
    assert torch.allclose(out.loss, whole.loss, rtol=1e-6, atol=0), (out.loss, whole.loss)
    for p, g in zip(model.parameters(), g0):  # float rounding: another order of the sums
        assert float((p.grad - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-12


def test_chunked_loss_never_holds_the_whole_logits():
    """Peak of the saved activations: the chunked head keeps no [T, V] tensor for backward."""
    h = torch.randn(2, 65, 16, requires_grad=True)
    w = torch.randn(4096, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (2, 65))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_lm_loss(h, w, labels, 16)
    assert max(saved) < 128 * 4096 / 4, max(saved)  # at most ~a chunk, never all 128 tokens
    loss.backward()
    assert h.grad is not None and w.grad is not None


def test_loss_chunk_and_pin_memory_checks():
    for bad, field in (("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens"),
                       ("train.pin_memory=maybe", "train.pin_memory")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, [bad])
    tc = load_config(None, []).train
    assert tc.loss_chunk_tokens == 0 and tc.pin_memory is False


def _loss_and_grads(model, ids, labels):
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, grads


def test_compiled_loss_is_one_graph_and_the_eager_loss():
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk"))
    ids = torch.randint(0, 512, (3, 21))
    labels = ids.clone()
    labels[0, 5:9] = -100
    eager, g0 = _loss_and_grads(model, ids, labels)
    counter = CompileCounter()  # dynamo's graphs, run as traced: the eager ops
    model.compile_lm_loss(backend=counter)
    out, g1 = _loss_and_grads(model, ids, labels)
    _loss_and_grads(model, ids, labels)
    assert out.logits is None and eager.logits is not None
    assert counter.frame_count == 1, counter.frame_count  # one graph, no break, no recompile
    assert torch.equal(out.loss, eager.loss) and all(map(torch.equal, g0, g1))
    model.compile_lm_loss()  # inductor: fused kernels, another order of the sums
    out, g2 = _loss_and_grads(model, ids, labels)
    assert torch.allclose(out.loss, eager.loss, rtol=1e-6, atol=0), (out.loss, eager.loss)
    for g, ref in zip(g2, g0):
        assert float((g - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) + 1e-12


def test_compile_loss_in_the_trainer(tmp_path):
    """``train.compile_loss=true``: the trainer's model computes its loss compiled; the first
    step's loss is the eager one up to float rounding."""
    seen = []
    base, _ = _trained(tmp_path, "base", [], steps=1, probe=seen.append)
    recs, _ = _trained(tmp_path, "compiled", ["train.compile_loss=true"], steps=1,
                       probe=seen.append)
    assert [t.model.compiled_lm_loss is not None for t in seen] == [False, True]
    assert abs(recs[0]["lm_loss"] - base[0]["lm_loss"]) <= 1e-6 * base[0]["lm_loss"]


def _trained(tmp_path, name, extra, steps=3, probe=None):
    from remoe.lab.bench.syncs import SyntheticData, close_trainer, step_config
    from remoe.train.trainer import Trainer

    cfg = step_config("relu", "micro", 32, 2, 3, tmp_path / name,
                      ["train.num_threads=1", "train.lr=3e-3", *extra])
    t = Trainer(cfg, progress=False, data=SyntheticData())
    try:
        recs = [t.train_step() for _ in range(steps)]
        if probe is not None:
            probe(t)
        return recs, [p.detach().clone() for p in t.model.parameters()]
    finally:
        close_trainer(t)


@pytest.mark.parametrize("option,extra", [
    ("train.prefetch=true", ()),
    ("train.cast_experts_once=true", ("train.precision=bf16",)),
])
def test_step_options_leave_the_step_unchanged(tmp_path, option, extra):
    """``train.prefetch`` reads the same batches (in another order of reads), and
    ``train.cast_experts_once`` under bf16 gives the same losses and weights bit for bit."""
    base_recs, base_w = _trained(tmp_path, "base", list(extra))
    recs, w = _trained(tmp_path, "opt", [option, *extra])
    keys = ("loss", "lm_loss", "reg_loss", "sparsity", "expert_counts", "grad_norm", "lambda")
    assert [[r[k] for k in keys] for r in recs] == [[r[k] for k in keys] for r in base_recs]
    assert all(torch.equal(a, b) for a, b in zip(base_w, w))


def test_step_option_checks():
    cfg = load_config(None, [])
    assert not (cfg.train.prefetch or cfg.train.cast_experts_once or cfg.train.compile_loss)
    for name in ("prefetch", "cast_experts_once", "compile_loss"):
        with pytest.raises(ConfigError, match=f"train.{name}"):
            load_config(None, [f"train.{name}=3"])
    with pytest.raises(ConfigError, match="train.cast_experts_once"):
        load_config(None, ["train.cast_experts_once=true", "train.fsdp=true"])
    with pytest.raises(ConfigError, match="train.compile_loss=true and train.loss_chunk_tokens"):
        load_config(None, ["train.compile_loss=true", "train.loss_chunk_tokens=64"])
