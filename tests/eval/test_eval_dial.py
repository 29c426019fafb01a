"""The gate-threshold dial: tau = 0 is the trained model; larger tau, fewer experts."""

import pytest
import torch

from remoe.errors import ConfigError
from remoe.eval.dial import threshold_sweep
from remoe.model.losses import evaluate_loss


def _batches(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (4, 17), generator=g), torch.zeros(4, dtype=torch.long))
            for _ in range(n)]


def test_sweep_at_zero_is_the_model_and_active_experts_fall_with_tau(make_micro_model):
    model = make_micro_model(router="relu", num_experts=8)
    batches = _batches()
    rows = threshold_sweep(model, lambda: batches, [0.0, 0.01, 0.05, 1e9])
    ref = evaluate_loss(model, batches, ["d"])
    assert rows[0]["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    active = [r["active_experts"] for r in rows]
    assert active[0] > 0 and all(b <= a for a, b in zip(active, active[1:]))
    assert active[-1] == 0  # nothing passes an infinite threshold: only the residual path
    assert all(r.gate_threshold == 0.0 for r in model.modules() if hasattr(r, "gate_threshold"))


def test_sweep_refuses_non_relu_models_and_bad_tau(make_micro_model):
    with pytest.raises(ConfigError, match="ReLU"):
        threshold_sweep(make_micro_model(router="topk", num_experts=8), lambda: _batches(), [0.0])
    with pytest.raises(ConfigError, match="gate-threshold"):
        threshold_sweep(make_micro_model(router="relu", num_experts=8), lambda: _batches(), [-1.0])
