"""The capacity plan (``train.dispatch_plan=capacity``): a data-dependent router's on-device plan
padded to a capacity the caller gives (``model(..., capacity=)``, one entry per MoE layer).

While the pairs fit, outputs and gradients equal the exact plan's bit for bit, with no host
synchronisation in the layer; pairs past the capacity are cut, no GEMM reads past the plan,
and the layer reports the overflow so that the caller redoes the step.
"""

import pytest
import torch

from remoe.machine.syncs import SyncCounter
from remoe.model import ReMoEConfig, ReMoEForCausalLM, dispatch
from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext


def test_a_cut_plan_holds_the_first_pairs_and_says_so():
    g = torch.Generator().manual_seed(3)
    mask_TN = torch.rand(40, 8, generator=g) < 0.4
    exact = dispatch.plan(mask_TN, on_device=False)
    P = exact.num_pairs
    for C in (P + 7, P, P - 5, 3):
        with SyncCounter() as sc:
            d = dispatch.plan(mask_TN, on_device=True, capacity=C)
        assert sc.count() == 0, sc.report()
        keep = min(C, P)
        assert d.num_pairs == C and int(d.valid_P.sum()) == keep
        assert torch.equal(d.token_idx_P[:keep], exact.token_idx_P[:keep])
        assert torch.equal(d.counts_N, exact.counts_N)  # the statistics see every pair
        assert int(d.row_counts_N.sum()) == keep and bool((d.row_counts_N >= 0).all())
        assert torch.equal(d.row_counts_N.cumsum(0), exact.counts_N.cumsum(0).clamp(max=C))
        assert float(d.overflow) == float(P > C)


def _layer_run(capacity, router="relu", seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2,
                                     router=router, expert_backend="grouped_mm"))
    torch.manual_seed(seed + 1)
    x = torch.randn(2, 12, 32, requires_grad=True)
    ctx = RouterContext(batch_size=2, seq_len=12, capacity=capacity)
    with SyncCounter() as sc, sc.watch(layer, "forward"):
        y, aux = layer(x, ctx)
        ((y ** 2).sum() + aux.reg_loss).backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return y.detach(), grads, aux, sc


@pytest.mark.parametrize("router", ["relu", "blockffn"])
def test_fitting_capacity_equals_the_exact_plan_without_a_sync(router):
    y0, g0, aux0, sc0 = _layer_run(None, router)  # the exact plan: nonzero, one sync
    assert sc0.count("forward") == 1
    pairs = int(aux0.active_counts_N.sum())
    for C in (pairs, pairs + 1, 24 * 8):
        y1, g1, aux1, sc = _layer_run(C, router)
        assert sc.count("forward") == 0 and sc.count("backward") == 0, sc.report()
        assert float(aux1.overflow) == 0.0
        assert torch.equal(y0, y1) and torch.equal(aux0.active_counts_N, aux1.active_counts_N)
        for a, b in zip(g0, g1):
            assert torch.equal(a, b)


def test_a_capacity_too_small_is_reported_and_stays_finite():
    y0, _, aux0, _ = _layer_run(None)
    pairs = int(aux0.active_counts_N.sum())
    y1, g1, aux1, _ = _layer_run(pairs // 2)
    assert float(aux1.overflow) == 1.0
    assert torch.equal(aux1.active_counts_N, aux0.active_counts_N)  # true counts, not cut
    assert torch.isfinite(y1).all() and all(torch.isfinite(g).all() for g in g1)
    assert not torch.equal(y0, y1)


def test_the_model_sums_overflows_over_layers():
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", router="relu", expert_backend="grouped_mm")
    model = ReMoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    assert model(ids).aux.overflow is None  # no capacity given: nothing reported
    L = cfg.backbone.num_layers
    assert float(model(ids, capacity=[32 * 64] * L).aux.overflow) == 0.0
    assert float(model(ids, capacity=[1] * L).aux.overflow) == L
    with pytest.raises(ValueError, match="capacity has 1 entries"):
        model(ids, capacity=[1])
