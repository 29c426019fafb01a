"""``model.topk_normalize``: renormalised TopK gates (Mixtral / Megatron) vs the paper's eq. 2."""

from __future__ import annotations

import pytest
import torch

from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext, build_router


def _router(router: str, normalize: bool, k: int = 2, G: int = 1):
    cfg = MoEConfig.build(d_model=8, d_ffn=16, num_experts=6, top_k=k, granularity=G, router=router,
                    topk_normalize=normalize, warmup_k=4, warmup_steps=3)
    torch.manual_seed(0)
    return build_router(cfg)


@pytest.mark.parametrize("router", ["topk", "topk_warmup"])
@pytest.mark.parametrize("step", [0, 10, None])
def test_normalized_gates_sum_to_one_per_token(router, step):
    r = _router(router, True)
    x_TD = torch.randn(11, 8, dtype=torch.float64)
    out = r(x_TD, RouterContext(batch_size=1, seq_len=11, step=step))
    sums_T = out.gates_TN.sum(-1)
    torch.testing.assert_close(sums_T, torch.ones_like(sums_T), rtol=0, atol=1e-12)
    # the gate of a kept expert is its probability over the kept experts' probabilities
    probs_TN = torch.softmax(r.logits(x_TD), -1)
    kept_TN = probs_TN * out.mask_TN
    torch.testing.assert_close(out.gates_TN, kept_TN / kept_TN.sum(-1, keepdim=True))
    assert int(out.mask_TN.sum(-1).unique().item()) == r.active_k(step)


def test_unnormalized_gates_are_eq2_bit_for_bit():
    """false: gates are the kept softmax probabilities exactly, as before the switch existed."""
    r = _router("topk", False)
    assert r.normalize is False
    x_TD = torch.randn(9, 8)
    out = r(x_TD, RouterContext(batch_size=1, seq_len=9))
    probs_TN = torch.softmax(r.logits(x_TD), dim=-1)
    idx_TK = probs_TN.topk(2, dim=-1).indices
    mask_TN = torch.zeros_like(probs_TN, dtype=torch.bool).scatter_(1, idx_TK, True)
    assert torch.equal(out.gates_TN, probs_TN * mask_TN)
    assert (out.gates_TN.sum(-1) < 1).all()


def test_switch_changes_gates_only():
    """Same weights: same mask and load-balancing loss; only the gate scale differs."""
    a, b = _router("topk", False), _router("topk", True)
    b.load_state_dict(a.state_dict())
    x_TD = torch.randn(7, 8)
    ctx = RouterContext(batch_size=1, seq_len=7)
    ra, rb = a(x_TD, ctx), b(x_TD, ctx)
    assert torch.equal(ra.mask_TN, rb.mask_TN)
    assert torch.equal(ra.aux_loss, rb.aux_loss)
    assert not torch.allclose(ra.gates_TN, rb.gates_TN)


def test_layer_output_scales_with_normalisation_at_k1():
    """k=1: the normalised gate is exactly 1, so the layer output is the expert output itself."""
    cfg = dict(d_model=8, d_ffn=16, num_experts=4, top_k=1, router="topk",
               expert_backend="reference")
    torch.manual_seed(1)
    plain = MoELayer(MoEConfig.build(**cfg, topk_normalize=False))
    norm = MoELayer(MoEConfig.build(**cfg, topk_normalize=True))
    norm.load_state_dict(plain.state_dict())
    x = torch.randn(1, 5, 8)
    y_plain, _ = plain(x)
    y_norm, _ = norm(x)
    probs = torch.softmax(plain.router.logits(x.reshape(5, 8)), -1).max(-1).values
    torch.testing.assert_close(y_plain.reshape(5, 8), y_norm.reshape(5, 8) * probs[:, None])
