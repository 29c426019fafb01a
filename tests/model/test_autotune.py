"""``expert_backend="measured"``: timed once per shape, cached, and numerically the same function."""

from __future__ import annotations

import json

import pytest
import torch

from remoe.model import autotune
from remoe.model.moe import MoEConfig, MoELayer


def _layer(backend: str, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(MoEConfig(d_model=32, d_ffn=64, num_experts=4, top_k=1, granularity=2,
                              router="relu", expert_backend=backend))


def _fwd_bwd(layer: MoELayer, x: torch.Tensor):
    xg = x.clone().requires_grad_(True)
    y, aux = layer(xg)
    (y.square().sum() + aux.reg_loss).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return y.detach(), xg.grad, grads


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REMOE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_auto_is_fused_bit_for_bit_and_measured_matches_it(cache_dir):
    x = torch.randn(2, 48, 32)
    auto, fused, measured = _layer("auto"), _layer("fused"), _layer("measured")
    assert auto.experts.resolve_backend(x) == "fused"
    ya, dxa, ga = _fwd_bwd(auto, x)
    yf, dxf, gf = _fwd_bwd(fused, x)
    # the default is the fused backend, exactly
    assert torch.equal(ya, yf) and torch.equal(dxa, dxf)
    assert all(torch.equal(a, b) for a, b in zip(ga, gf))
    ym, dxm, gm = _fwd_bwd(measured, x)
    chosen = {d["backend"] for d in measured.experts.tuner.decisions.values()}
    assert len(chosen) == 1 and chosen <= set(autotune.CANDIDATES)
    if chosen == {"fused"}:  # the same kernels: the same bits
        assert torch.equal(ym, ya) and all(torch.equal(a, b) for a, b in zip(gm, ga))
    # either way, the same function to fp32 rounding (the documented tolerance)
    torch.testing.assert_close(ym, ya, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dxm, dxa, rtol=1e-5, atol=1e-6)
    for a, b in zip(gm, ga):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_decision_is_cached_in_memory_and_on_disk(cache_dir, monkeypatch):
    x = torch.randn(2, 48, 32)
    first = _layer("measured")
    _fwd_bwd(first, x)
    data = json.loads((cache_dir / "expert_backend.json").read_text())
    (key, rec), = data.items()
    assert "|train" in key and rec["backend"] in autotune.CANDIDATES
    assert set(rec["ms"]) == set(autotune.CANDIDATES)

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(autotune, "measure", no_measuring)
    _fwd_bwd(first, x)  # in memory
    second = _layer("measured", seed=1)  # another layer / run: read from the file
    _fwd_bwd(second, x)
    assert second.experts.tuner.decisions[key]["backend"] == rec["backend"]
    with torch.no_grad():  # inference is another key: measured on its own
        with pytest.raises(AssertionError, match="measured again"):
            second(x)


def test_measure_picks_the_faster_candidate():
    def burn(n):
        s = 0
        for i in range(n):
            s += i
        return s

    work = {"fused": 200_000, "grouped_mm": 20_000}
    rec = autotune.measure(lambda b: burn(work[b]), reps=3)
    assert rec["backend"] == "grouped_mm" and rec["ms"]["grouped_mm"] < rec["ms"]["fused"]


def test_nearby_pair_counts_share_a_key():
    x = torch.zeros(4, 8)
    k = [autotune.shape_key(x, 8, 16, p, True) for p in (1000, 1050, 1500, 4000)]
    assert k[0] == k[1] and k[0] != k[2] != k[3]
    assert autotune.shape_key(x, 8, 16, 1000, False) != k[0]
