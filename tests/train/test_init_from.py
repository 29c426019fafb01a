"""train.init_from: continue training from a remoe model / checkpoint / run, or from every
source `remoe convert` reads (converted on the fly), with routing overrides; the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.train.trainer import Trainer

HF_BACKBONE = dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _cfg(make_overrides, out, name, **extra):
    """Overrides of the micro runs, without the preset when init_from is given."""
    ov = make_overrides(out, name, **extra)
    if "train.init_from" in extra:
        ov = [o for o in ov if not o.startswith("model.preset=")]
    return load_config(None, ov)


def _train(cfg):
    t = Trainer(cfg, progress=False)
    try:
        return t, t.train()
    finally:
        t.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory, micro_data_cfg):
    """Three finished micro runs (6 steps): ReLU, TopK, dense."""
    from tests.train.conftest import _overrides

    out = tmp_path_factory.mktemp("sources")
    for name, router in (("relu", "relu"), ("topk", "topk"), ("dense", "dense")):
        _train(load_config(None, _overrides(micro_data_cfg, out, name, **{
            "model.router": router, "model.num_experts": 4})))
    return out


def _sd(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_init_from_a_final_dir_keeps_the_weights_and_measures_lambda(sources, make_overrides,
                                                                     tmp_path):
    from remoe import ReMoEForCausalLM

    src = ReMoEForCausalLM.from_pretrained(sources / "relu" / "final")
    cfg = _cfg(make_overrides, tmp_path, "cont", **{"train.init_from": sources / "relu" / "final",
                                                    "train.max_steps": 3})
    t = Trainer(cfg, progress=False)
    try:
        got, want = _sd(t.model), _sd(src)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert t.step == 0 and not t.optimizer.state  # fresh optimizer and schedule
        lam = t.init.lambdas[0]  # the source run's own lambda, where it stopped
        final = json.loads((sources / "relu" / "summary.json").read_text())["final_lambda"]
        assert t.controller.coeff == lam == final
        assert t.init.lambda_info["lambda_rule"] == "the source run's final lambda"
        assert 0 < t.init.lambda_info["source_density"] <= 1
        summary = t.train()
    finally:
        t.close()
    assert summary["steps"] == 3
    rec = json.loads((tmp_path / "cont" / "init_from.json").read_text())
    assert rec["lambda_start"] == [lam] and rec["source_router"] == "relu"
    first = json.loads((tmp_path / "cont" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["lambda"] == lam


def test_init_from_a_checkpoint_continues_with_its_own_lambda(sources, make_overrides, tmp_path):
    from remoe import rundir

    ckpt = sources / "relu" / "checkpoints" / "step_0000003"
    saved = rundir.load_state(ckpt)["controller"]["value"]
    t = Trainer(_cfg(make_overrides, tmp_path, "c", **{"train.init_from": ckpt}), progress=False)
    t.close()
    assert t.controller.coeff == saved and t.init.lambda_info["lambda_rule"].startswith("the check")
    t = Trainer(_cfg(make_overrides, tmp_path, "d", **{"train.init_from": ckpt,
                                                       "train.init_lambda": 0.003}), progress=False)
    t.close()
    assert t.controller.coeff == 0.003


def test_a_run_dir_resumes_from_its_own_checkpoint(sources, make_overrides, tmp_path,
                                                   train_then_crash):
    over = {"train.init_from": sources / "relu", "train.max_steps": 4, "train.save_every": 2}
    train_then_crash(_cfg(make_overrides, tmp_path, "r", **over), steps=2)
    t = Trainer(_cfg(make_overrides, tmp_path, "r", **over), resume=True, progress=False)
    try:
        assert t.step == 2 and t.init is None  # the model came from init_from.json
        assert t.train()["steps"] == 4
    finally:
        t.close()


def test_router_swap_topk_to_relu_centres_the_router_and_keeps_the_experts(sources,
                                                                          make_overrides, tmp_path):
    from remoe import ReMoEForCausalLM

    src = ReMoEForCausalLM.from_pretrained(sources / "topk" / "final")
    t = Trainer(_cfg(make_overrides, tmp_path, "swap", **{"train.init_from": sources / "topk",
                                                          "model.router": "relu"}), progress=False)
    t.close()
    assert t.model_cfg.routing.router == "relu" and t.controller is not None
    for a, b in zip(t.model.layers, src.layers):
        w = b.ffn.router.weight
        assert torch.allclose(a.ffn.router.weight, w - w.mean(0, keepdim=True))
        assert torch.equal(a.ffn.experts.w_in_ND2H, b.ffn.experts.w_in_ND2H)
        assert torch.equal(a.attn.q_proj.weight, b.attn.q_proj.weight)
    assert "topk -> relu" in t.init.conversion[0]
    # no lambda to inherit from a TopK run: the swapped model is denser than its target, so
    # lambda starts at the gradient balance (not lambda0 = 1e-8)
    info = t.init.lambda_info
    assert info["source_density"] > 0.25 and info["lambda_rule"].startswith("gradient balance")
    assert t.controller.coeff == info["measured_lambda"][0] > 1e-6


def test_upcycle_a_dense_run_to_relu_experts(sources, make_overrides, tmp_path):
    from remoe import ReMoEForCausalLM

    src = ReMoEForCausalLM.from_pretrained(sources / "dense" / "final")
    t = Trainer(_cfg(make_overrides, tmp_path, "up", **{
        "train.init_from": sources / "dense", "model.router": "relu", "model.num_experts": 8,
        "train.max_steps": 2}), progress=False)
    try:
        ffn = src.layers[0].ffn.ffn
        w = t.model.layers[0].ffn.experts.w_in_ND2H
        assert t.model_cfg.routing.num_experts == 8 and t.model_cfg.routing.router == "relu"
        assert torch.equal(w[5], torch.cat([ffn.w_gate.weight.t(), ffn.w_up.weight.t()], 1))
        assert t.train()["steps"] == 2
    finally:
        t.close()


def _hf(family):
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                              OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM)

    from tests.convert.conftest import randomize

    torch.manual_seed(0)
    if family == "llama":
        m = LlamaForCausalLM(LlamaConfig(**HF_BACKBONE, intermediate_size=48))
    elif family == "mixtral":
        m = MixtralForCausalLM(MixtralConfig(**HF_BACKBONE, intermediate_size=24,
                                             num_local_experts=4, num_experts_per_tok=2))
    elif family == "qwen2_moe":
        m = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **HF_BACKBONE, intermediate_size=40, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False, qkv_bias=True))
    else:
        m = OlmoeForCausalLM(OlmoeConfig(**HF_BACKBONE, intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True))
    return randomize(m, seed=3)


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe", "olmoe"])
def test_every_converter_source_trains_as_itself_and_with_a_relu_router(family, make_overrides,
                                                                        tmp_path):
    hf = _hf(family)
    hf.save_pretrained(tmp_path / "src")
    t = Trainer(_cfg(make_overrides, tmp_path, "same", **{"train.init_from": tmp_path / "src"}),
                progress=False)
    t.close()
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t.model.eval()
        assert torch.allclose(t.model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert t.model_cfg.routing.router == ("dense" if family == "llama" else "topk")
    _, summary = _train(_cfg(make_overrides, tmp_path, "relu", **{
        "train.init_from": tmp_path / "src", "model.router": "relu", "train.max_steps": 2}))
    assert summary["steps"] == 2 and summary["final_lambda"] is not None


@pytest.mark.parametrize("over, field", [
    ({"model.hidden_size": 128}, "model.hidden_size"),
    ({"model.num_experts": 8}, "model.num_experts"),
    ({"model.granularity": 2}, "model.granularity"),
    ({"model.router": "dense"}, "model.router"),
    ({"model.rope_theta": 10.0}, "model.rope_theta"),
    ({"train.seq_len": 512}, "train.seq_len"),
])
def test_shape_overrides_are_refused_naming_the_field(sources, make_overrides, tmp_path, over,
                                                     field):
    with pytest.raises(ConfigError) as e:
        Trainer(_cfg(make_overrides, tmp_path, "x", **{"train.init_from": sources / "relu",
                                                       **over}), progress=False)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_refused_sources_and_tokenizers(sources, make_overrides, tmp_path):
    import shutil

    def refused(src, **extra):
        with pytest.raises(ConfigError) as e:
            Trainer(_cfg(make_overrides, tmp_path, "x", **{"train.init_from": src, **extra}),
                    progress=False)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "does not exist" in refused(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "holds no model" in refused(tmp_path / "empty")
    (tmp_path / "q3").mkdir()
    (tmp_path / "q3" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert "per head" in refused(tmp_path / "q3") or "Qwen3" in refused(tmp_path / "q3")
    # another vocabulary: two token ids swapped in the source's tokenizer
    bad = tmp_path / "badtok"
    shutil.copytree(sources / "relu" / "final", bad)
    doc = json.loads((bad / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(doc))
    assert refused(bad).startswith("data.tokenizer")
    # a model vocabulary smaller than the data's
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**{**HF_BACKBONE, "vocab_size": 256}, intermediate_size=48)
                     ).save_pretrained(tmp_path / "small")
    assert refused(tmp_path / "small").startswith("data.tokenizer")
    with pytest.raises(ConfigError, match="^model.preset='micro' cannot be combined"):
        load_config(None, make_overrides(tmp_path, "x", **{"train.init_from": sources / "relu"}))


def test_cli_drops_the_default_models_section_and_refuses_in_one_line(sources, make_overrides,
                                                                      tmp_path, capsys):
    from remoe.cli import main

    ov = [o for o in make_overrides(tmp_path, "cli", **{"train.init_from": sources / "relu"})
          if not o.startswith("model.preset=")]
    assert main(["train", "--print-config", *[f"--set={o}" for o in ov]]) == 0
    printed = capsys.readouterr().out
    assert "model: {}" in printed and "init_from:" in printed
    assert main(["train", "--no-progress", *[f"--set={o}" for o in ov],
                 "--set=model.num_layers=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.num_layers=3" in err[0]


def test_two_ranks_start_from_the_same_measured_lambda(sources, make_overrides, run_cmd,
                                                        free_port, tmp_path):
    """torchrun, 2 gloo ranks: each rank measures the gradient balance on its own batch; the
    squared norms are summed, so both hold one lambda (every save checks that the ranks agree)."""
    import sys

    ov = [o for o in make_overrides(tmp_path, "ddp", **{
        "train.init_from": sources / "topk", "model.router": "relu", "train.max_steps": 2,
        "train.save_every": 1, "train.eval_every": 0, "analysis.record_masks_every": 0,
        "train.micro_batch_size": 2, "train.num_threads": 1}) if not o.startswith("model.preset=")]
    run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
             f"--master_port={free_port()}", "-m", "remoe.cli", "train", "--no-progress",
             *[f"--set={o}" for o in ov]])
    rec = json.loads((tmp_path / "ddp" / "init_from.json").read_text())
    assert rec["lambda_rule"].startswith("gradient balance") and rec["lambda_start"][0] > 1e-6
    first = json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["lambda"] == rec["lambda_start"][0]
