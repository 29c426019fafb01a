"""ReMoEForCausalLM: HF round trip, generation, padding, routing statistics, autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import remoe  # noqa: F401  (registers the "remoe" model type with the Auto classes)
from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model.llama import rope_cos_sin
from remoe.model.routers import Router, RouterContext

V = 512  # the micro preset's vocabulary


def _model(router: str = "relu", seed: int = 0, **kw) -> ReMoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ReMoEConfig.from_preset("micro", router=router, eos_token_id=None, **kw)
    return ReMoEForCausalLM(cfg).eval()


def _ids(B: int, S: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (B, S), generator=g)


# ---------------------------------------------------------------- Hugging Face round trip


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = _model("relu", num_experts=4, top_k=2, granularity=2)
    model.save_pretrained(tmp_path)
    loaded = ReMoEForCausalLM.from_pretrained(tmp_path).eval()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(auto) is ReMoEForCausalLM
    assert isinstance(AutoConfig.from_pretrained(tmp_path), ReMoEConfig)
    sd = model.state_dict()
    for other in (loaded, auto):
        assert other.config.routing.top_k == 2 and other.config.routing.granularity == 2
        assert other.config.routing.num_experts == 4 and other.config.routing.router == "relu"
        osd = other.state_dict()
        assert osd.keys() == sd.keys()
        for k in sd:
            assert osd[k].dtype == sd[k].dtype and torch.equal(osd[k], sd[k]), k
    # untied embeddings stay untied
    assert not torch.equal(loaded.lm_head.weight, loaded.embed_tokens.weight)
    ids = _ids(2, 7)
    with torch.no_grad():
        ref = model(ids)
        for other in (loaded, auto):
            out = other(ids)
            assert torch.equal(out.logits, ref.logits)
            assert torch.equal(out.aux.active_counts_LN, ref.aux.active_counts_LN)


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("router", ["relu", "topk", "dense"])
def test_generate_with_cache_equals_without(router):
    model = _model(router)
    ids = _ids(2, 6)
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        full = model.generate(ids, use_cache=False, **kw)
    assert cached.sequences.shape == (2, 14)
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("router", ["relu", "topk"])
def test_left_padded_batch_generation_equals_single(router):
    model = _model(router, seed=2)
    short, long = _ids(1, 4, seed=3), _ids(1, 7, seed=4)
    pad = 3
    batch = torch.cat([F.pad(short, (pad, 0), value=0), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, **kw)
        alone = [model.generate(x, **kw) for x in (short, long)]
    assert torch.equal(both.sequences[0, pad:], alone[0].sequences[0])
    assert torch.equal(both.sequences[1], alone[1].sequences[0])
    for step, scores in enumerate(both.scores):
        torch.testing.assert_close(scores[0], alone[0].scores[step][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(scores[1], alone[1].scores[step][0], rtol=1e-4, atol=1e-5)


def test_left_padded_forward_matches_unpadded():
    model = _model("relu", seed=5)
    x = _ids(1, 5, seed=6)
    padded = F.pad(x, (2, 0), value=0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        a = model(x).logits
        b = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(b[:, 2:], a, rtol=1e-5, atol=1e-6)


def test_attention_is_causal_and_prefill_in_chunks_matches():
    model = _model("relu", seed=7)
    ids = _ids(1, 10, seed=8)
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % V
    with torch.no_grad():
        a = model(ids).logits
        b = model(changed).logits
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-6)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-4
        # prefill 6 tokens, then a chunk of 4 with the cache: same logits as one pass
        first = model(ids[:, :6], use_cache=True)
        second = model(ids[:, 6:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), a, rtol=1e-5, atol=1e-6)


def test_lm_loss_is_shifted_cross_entropy_with_ignore_index():
    model = _model("topk")
    ids = _ids(2, 6)
    labels = ids.clone()
    labels[0, 3] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, V)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    expected = F.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, expected)


# ---------------------------------------------------------------- routing statistics


def _capture_routings(model):
    routings = []
    handles = [m.register_forward_hook(lambda mod, inp, out: routings.append(out))
               for m in model.modules() if isinstance(m, Router)]
    return routings, handles


def test_model_aux_matches_per_layer_routing():
    model = _model("relu", num_experts=4, top_k=1)
    routings, handles = _capture_routings(model)
    ids = _ids(2, 8)
    with torch.no_grad():
        aux = model(ids, record_masks=True).aux
    for h in handles:
        h.remove()
    L, T, E, k = 2, 16, 4, 1
    assert len(routings) == L and aux.num_moe_layers == L and aux.num_tokens == T
    expected_reg = []
    for r, mask in zip(routings, aux.masks):
        assert torch.equal(mask, r.mask_TN)
        f = E / (k * T) * (r.gates_TN > 0).sum(0).double()
        expected_reg.append((f * r.gates_TN.double()).sum() / T)
    # L_reg,lb = 1/(L T) sum_l sum_t sum_e f_le R_te
    assert aux.reg_loss.item() == pytest.approx(torch.stack(expected_reg).mean().item(), rel=1e-5)
    counts = torch.stack([m.sum(0) for m in aux.masks]).float()
    assert torch.equal(aux.active_counts_LN, counts)
    active = sum(int(m.sum()) for m in aux.masks)
    assert aux.sparsity.item() == pytest.approx(1 - active / (L * T * E), abs=1e-6)
    assert aux.layer_sparsity.tolist() == pytest.approx(
        [1 - int(m.sum()) / (T * E) for m in aux.masks], abs=1e-6)
    assert 0.0 < aux.sparsity.item() < 1.0
    assert aux.aux_loss.item() == 0.0


def test_model_aux_loss_sums_topk_layers():
    model = _model("topk", num_experts=4, top_k=1)
    routings, handles = _capture_routings(model)
    with torch.no_grad():
        aux = model(_ids(2, 5)).aux
    for h in handles:
        h.remove()
    assert aux.aux_loss.item() == pytest.approx(sum(r.aux_loss.item() for r in routings), rel=1e-6)
    assert aux.reg_loss.item() == 0.0
    assert aux.sparsity.item() == pytest.approx(1 - 1 / 4)  # exactly k of E per token
    assert aux.masks is None


@pytest.mark.parametrize("router", ["dense", "dense_wide"])
def test_dense_router_has_no_routing_statistics(router):
    model = _model(router)
    with torch.no_grad():
        aux = model(_ids(2, 5), record_masks=True).aux
    assert aux.sparsity.item() == 0.0
    assert aux.active_counts_LN.numel() == 0 and aux.num_moe_layers == 0
    assert aux.layer_sparsity.numel() == 0
    assert aux.reg_loss.item() == 0.0 and aux.aux_loss.item() == 0.0
    assert not aux.masks


def test_token_with_no_active_expert_passes_through_the_ffn_unchanged():
    model = _model("relu", seed=3)
    block = model.layers[0]
    torch.manual_seed(4)
    x = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    cos, sin = rope_cos_sin(pos, model.config.head_dim, model.config.backbone.rope_theta)
    ctx = RouterContext(batch_size=1, seq_len=6, record_masks=True)
    captured = {}

    def keep_input(module, inputs, output) -> None:
        captured["in"] = inputs[0]

    h = block.ffn.register_forward_hook(keep_input)
    with torch.no_grad():
        block(x, cos, sin, None, None, ctx)
        h.remove()
        h0 = captured["in"].reshape(6, 64)[2]  # FFN input of token 2
        W = block.ffn.router.weight
        W -= (W @ h0 + 1.0)[:, None] * h0[None] / (h0 @ h0)  # token 2: every logit = -1
        out, aux = block(x, cos, sin, None, None, ctx)
        attn_only = x + block.attn(block.attn_norm(x), cos, sin, None, None)
    assert aux.mask_TN[2].sum() == 0 and aux.mask_TN.sum() > 0
    assert torch.equal(out[0, 2], attn_only[0, 2])  # block output = input + attention part
    routed = aux.mask_TN.any(1)
    assert (out[0, routed] != attn_only[0, routed]).any(-1).all()


# ---------------------------------------------------------------- autocast


@pytest.mark.parametrize("router", ["relu", "topk"])
def test_bf16_autocast_forward_backward_keeps_router_logits_fp32(router, monkeypatch):
    model = _model(router).train()
    seen = []
    original = Router.logits

    def recording_logits(self, x_TD):
        out = original(self, x_TD)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(Router, "logits", recording_logits)
    ids = _ids(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids, train_step=0)
        loss = out.loss + 1e-3 * out.aux.reg_loss + out.aux.aux_loss
    assert out.logits.dtype == torch.bfloat16  # autocast really is active
    assert seen == [torch.float32] * model.config.backbone.num_layers
    assert out.aux.reg_loss.dtype == torch.float32 and out.loss.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name
    assert all(layer.ffn.router.weight.grad.abs().sum() > 0 for layer in model.layers)
