"""The padded, sync-free dispatch plan of data-dependent routers on the device path.

On ``grouped_mm`` (the CUDA backend) a router whose pair count is data-dependent (ReLU,
BlockFFN) gets a plan of static capacity (T*N, or T*max_active): the real pairs first, then
padding rows that ``valid_P`` marks. Outputs and gradients must equal the exact plan's
(``nonzero``, one host sync) bit for bit, also when ``grouped_mm`` leaves garbage in the rows
past its last offset, as CUDA's does.
"""

import pytest
import torch
import torch.nn.functional as F

from remoe.machine.syncs import SyncCounter
from remoe.model import dispatch
from remoe.model import experts as experts_mod
from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext


@pytest.mark.parametrize("T,N,p", [(37, 8, 0.3), (64, 16, 0.0), (5, 4, 1.0), (16, 4, 0.5)])
def test_padded_plan_holds_the_exact_pairs_then_padding(T, N, p):
    g = torch.Generator().manual_seed(T * N + 1)
    mask_TN = torch.rand(T, N, generator=g) < p
    exact = dispatch.plan(mask_TN, on_device=False)
    with SyncCounter() as sc:
        padded = dispatch.plan(mask_TN, on_device=True, capacity=T * N)
    assert sc.count() == 0, sc.report()
    P = exact.num_pairs
    assert padded.num_pairs == T * N and padded.valid_P.shape == (T * N,)
    assert int(padded.valid_P.sum()) == P and bool(padded.valid_P[:P].all())
    assert torch.equal(padded.token_idx_P[:P], exact.token_idx_P)
    assert torch.equal(padded.expert_idx_P[:P], exact.expert_idx_P)
    assert torch.equal(padded.counts_N, exact.counts_N)
    assert not padded.token_idx_P[P:].any() and not padded.expert_idx_P[P:].any()
    rows = torch.randn(T * N, 3)
    masked = dispatch.mask_padding(rows, padded)
    assert torch.equal(masked[:P], rows[:P]) and not masked[P:].any()


class _PoisonOut(torch.autograd.Function):
    """Rows past ``end`` of the output become NaN (what CUDA's grouped_mm leaves there)."""

    @staticmethod
    def forward(ctx, y, end):
        y = y.clone()
        y[end:] = float("nan")
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _PoisonGrad(torch.autograd.Function):
    """Identity whose backward turns the input gradient's rows past ``end`` into NaN."""

    @staticmethod
    def forward(ctx, x, end):
        ctx.end = end
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[ctx.end:] = float("nan")
        return g, None


def _poisoned_grouped(x_PK, w_NKM, offs_N):
    end = int(offs_N[-1]) if offs_N.numel() else 0
    y = F.grouped_mm(_PoisonGrad.apply(x_PK, end), w_NKM, offs=offs_N)
    return experts_mod._ContiguousGrad.apply(_PoisonOut.apply(y, end))


def _run(router, backend, static, zero_router=False, max_active=0, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2, granularity=2,
                               router=router, expert_backend=backend, max_active=max_active))
    layer.static_plan = static
    if zero_router:  # no token activates any expert: every row of the padded plan is padding
        with torch.no_grad():
            layer.router.weight.zero_()
    torch.manual_seed(seed + 1)
    x = torch.randn(2, 12, 32, requires_grad=True)
    ctx = RouterContext(batch_size=2, seq_len=12)
    with SyncCounter() as sc, sc.watch(layer, "forward"):
        y, aux = layer(x, ctx)
        ((y ** 2).sum() + aux.reg_loss + aux.aux_loss).backward()
    grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                        for p in layer.parameters()]
    return y.detach(), grads, aux.active_counts_N, sc


@pytest.mark.parametrize("router,max_active,zero_router", [
    ("relu", 0, False), ("relu", 3, False), ("blockffn", 0, False), ("relu", 0, True)])
def test_padded_plan_equals_the_exact_plan_under_garbage(monkeypatch, router, max_active,
                                                        zero_router):
    monkeypatch.setattr(experts_mod, "_grouped", _poisoned_grouped)
    y0, g0, c0, _ = _run(router, "grouped_mm", False, zero_router, max_active)
    y1, g1, c1, _ = _run(router, "grouped_mm", True, zero_router, max_active)  # the poison syncs
    assert torch.isfinite(y1).all() and all(torch.isfinite(g).all() for g in g1)
    assert torch.equal(y0, y1) and torch.equal(c0, c1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


@pytest.mark.parametrize("router", ["relu", "blockffn"])
def test_padded_plan_is_bit_equal_on_the_reference_backend(router):
    # (the reference loop splits by counts on the host: it is no sync-free path)
    y0, g0, _, _ = _run(router, "reference", False)
    y1, g1, _, _ = _run(router, "reference", True)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def test_relu_declares_its_capacity():
    T = 20
    for max_active, bound in ((0, None), (3, T * 3)):
        layer = MoELayer(MoEConfig.build(d_model=16, d_ffn=32, num_experts=8, top_k=1,
                                   router="relu", max_active=max_active))
        r = layer.router(torch.randn(T, 16), RouterContext(batch_size=1, seq_len=T))
        assert r.num_pairs is None and r.max_pairs == bound
        assert int(r.mask_TN.sum(1).max()) <= (max_active or 8)


def test_default_is_the_exact_plan():
    """``static_plan=False`` (``train.dispatch_plan=exact``): the plan of the active pairs, one
    ``nonzero`` -- on an H200 faster than the padded plan, eager and compiled (docs/SCALING.md)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2, router="relu",
                               expert_backend="grouped_mm"))
    assert layer.static_plan is False
    with SyncCounter() as sc:
        layer(torch.randn(24, 32))
    assert [e.what for e in sc.events] == ["aten.nonzero.default"], sc.report()
