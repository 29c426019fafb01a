"""The fused CPU expert path (dispatch.BlockLayout + dispatch.FusedExpertsFn) == the reference path.

Outputs and every gradient (x, gates, w_in, w_out) on random masks with idle experts, idle
tokens, G > 1, padded and jagged chunks, recompute on/off, and inference without autograd.
"""

from __future__ import annotations

import pytest
import torch

from remoe.model import dispatch
from remoe.model.experts import swiglu_reference
from remoe.model.dispatch import FusedExpertsFn, layout_of, swiglu_fused
from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext


def _reference(x_TD, gates_TN, w_in, w_out):
    plan = dispatch.plan(gates_TN.detach() != 0)
    y_PD = swiglu_reference(dispatch.permute(x_TD, plan), w_in, w_out, plan.counts_N)
    return dispatch.unpermute(y_PD, dispatch.pair_gates(gates_TN, plan), plan, x_TD.shape[0])


def _problem(T, N, D, H, density, seed, dtype=torch.float64, idle_experts=(0,), idle_tokens=(1,),
             skew=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, N, generator=g) < density
    if skew:  # expert n gets ~ n^2 tokens: uneven groups -> jagged chunks
        mask &= torch.rand(T, N, generator=g) < (torch.arange(N, dtype=torch.float) + 1) ** 2 / N ** 2
    for e in idle_experts:
        mask[:, e] = False
    for t in idle_tokens:
        mask[t] = False
    gates = torch.rand(T, N, generator=g, dtype=dtype) * mask
    x = torch.randn(T, D, generator=g, dtype=dtype)
    w_in = torch.randn(N, D, 2 * H, generator=g, dtype=dtype) * 0.3
    w_out = torch.randn(N, H, D, generator=g, dtype=dtype) * 0.3
    return x, gates, w_in, w_out


def _run(fn, x, gates, w_in, w_out, c):
    leaves = [t.clone().requires_grad_(True) for t in (x, gates, w_in, w_out)]
    y = fn(*leaves)
    (y * c).sum().backward()
    return y.detach(), [t.grad for t in leaves]


CASES = [  # T, N, D, H, density, skew, max_rows
    (40, 4, 8, 16, 0.4, False, 64),  # E=4-like: few large groups
    (64, 32, 8, 4, 0.25, False, 48),  # many tiny groups (G>1-like), several padded chunks
    (50, 16, 12, 8, 0.5, True, 40),  # uneven groups -> jagged chunks
    (30, 8, 8, 8, 0.9, False, 1000),  # near-dense (ReLU stage I), one chunk
    (33, 6, 4, 4, 0.3, False, 1),  # one expert per chunk
]


@pytest.mark.parametrize("T, N, D, H, density, skew, max_rows", CASES)
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_equals_reference(T, N, D, H, density, skew, max_rows, recompute):
    x, gates, w_in, w_out = _problem(T, N, D, H, density, seed=T + N, skew=skew)
    c = torch.randn(T, D, dtype=x.dtype)
    mask = gates != 0
    assert not mask[:, 0].any() and not mask[1].any()  # an idle expert and an idle token
    plan = dispatch.plan(mask)

    def fused(x, g, wi, wo):
        return swiglu_fused(x, g, wi, wo, plan, recompute=recompute, max_rows=max_rows)

    y_f, g_f = _run(fused, x, gates, w_in, w_out, c)
    y_r, g_r = _run(_reference, x, gates, w_in, w_out, c)
    torch.testing.assert_close(y_f, y_r, rtol=1e-10, atol=1e-12)
    for a, b, name in zip(g_f, g_r, ("x", "gates", "w_in", "w_out")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert torch.equal(y_f[1], torch.zeros(D, dtype=x.dtype))  # idle token: exact zeros
    assert torch.equal(g_f[2][0], torch.zeros_like(g_f[2][0]))  # idle expert: exact zero grads
    assert torch.equal(g_f[3][0], torch.zeros_like(g_f[3][0]))
    assert torch.equal(g_f[1][~mask], torch.zeros_like(g_f[1][~mask]))  # inactive gates: 0


def test_layouts_cover_both_kinds_and_every_pair_once():
    kinds = set()
    for T, N, D, H, density, skew, max_rows in CASES:
        x, gates, *_ = _problem(T, N, D, H, density, seed=T + N, skew=skew)
        plan = dispatch.plan(gates != 0)
        lay = layout_of(plan, max_rows)
        kinds |= {ch.padded for ch in lay.chunks if ch.r1 > ch.r0}
        assert lay.chunks[0].e0 == 0 and lay.chunks[-1].e1 == N and lay.chunks[-1].r1 == lay.num_rows
        assert all(a.e1 == b.e0 and a.r1 == b.r0 for a, b in zip(lay.chunks, lay.chunks[1:]))
        assert lay.row_P.unique().numel() == plan.num_pairs  # each pair has its own row
        assert torch.equal(lay.tok_R[lay.row_P], plan.token_idx_P)
        for ch in lay.chunks:  # a chunk's rows belong to its experts
            rows_P = (lay.row_P >= ch.r0) & (lay.row_P < ch.r1)
            ex = plan.expert_idx_P[rows_P]
            assert ex.numel() == 0 or (ex.min() >= ch.e0 and ex.max() < ch.e1)
            if ch.padded:
                assert ch.r1 - ch.r0 == (ch.e1 - ch.e0) * ch.m
                assert max(lay.counts[ch.e0:ch.e1]) <= ch.m
    assert kinds == {True, False}


def test_plan_matches_nonzero_order():
    torch.manual_seed(0)
    mask = torch.rand(37, 11) < 0.3
    mask[:, 3] = False
    plan = dispatch.plan(mask)
    pairs = mask.t().nonzero()
    assert torch.equal(plan.expert_idx_P, pairs[:, 0]) and torch.equal(plan.token_idx_P, pairs[:, 1])
    assert torch.equal(plan.counts_N, mask.sum(0))
    empty = dispatch.plan(torch.zeros(0, 4, dtype=torch.bool))
    assert empty.num_pairs == 0 and empty.counts_N.tolist() == [0, 0, 0, 0]


def test_no_active_pair_and_inference_without_grad():
    x, gates, w_in, w_out = _problem(12, 4, 8, 4, 0.0, seed=3)
    plan = dispatch.plan(gates != 0)
    y, grads = _run(lambda *a: swiglu_fused(*a, plan), x, gates, w_in, w_out, torch.randn(12, 8,
                                                                                          dtype=x.dtype))
    assert torch.equal(y, torch.zeros_like(y))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)

    x, gates, w_in, w_out = _problem(20, 8, 8, 4, 0.4, seed=4)
    plan = dispatch.plan(gates != 0)
    with torch.no_grad():
        y = swiglu_fused(x, gates, w_in, w_out, plan, max_rows=16)
    torch.testing.assert_close(y, _reference(x, gates, w_in, w_out), rtol=1e-10, atol=1e-12)


def test_partial_gradients_and_float32():
    x, gates, w_in, w_out = _problem(24, 8, 16, 8, 0.3, seed=5, dtype=torch.float32)
    plan = dispatch.plan(gates != 0)
    wi, wo = w_in.clone().requires_grad_(True), w_out.clone().requires_grad_(True)
    y = FusedExpertsFn.apply(x, gates, wi, wo, plan, 32, True)  # x, gates: no grad
    y.sum().backward()
    wi2, wo2 = w_in.clone().requires_grad_(True), w_out.clone().requires_grad_(True)
    _reference(x, gates, wi2, wo2).sum().backward()
    torch.testing.assert_close(wi.grad, wi2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wo.grad, wo2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("router, E, k, G", [("relu", 4, 1, 4), ("topk", 8, 2, 2), ("relu", 8, 1, 1)])
def test_moe_layer_auto_uses_fused_and_matches_reference(router, E, k, G):
    layers = []
    for backend in ("auto", "reference"):
        torch.manual_seed(0)
        layers.append(MoELayer(MoEConfig.build(d_model=16, d_ffn=64, num_experts=E, top_k=k,
                                         granularity=G, router=router, expert_backend=backend,
                                         init_std=0.3)))
    layers[1].load_state_dict(layers[0].state_dict())
    assert layers[0].experts.resolve_backend(torch.zeros(1, 16)) == "fused"
    torch.manual_seed(1)
    x = torch.randn(2, 20, 16)
    c = torch.randn_like(x)
    outs = []
    for layer in layers:
        xx = x.clone().requires_grad_(True)
        y, aux = layer(xx, RouterContext(batch_size=2, seq_len=20))
        ((y * c).sum() + aux.reg_loss + aux.aux_loss).backward()
        outs.append([y.detach(), xx.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
