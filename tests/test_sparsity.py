"""LambdaController: paper eq. 6, lambda_{i+1} = lambda_i * alpha ** sign((1 - k/E) - S_i)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from remoe import ReMoEConfig
from remoe.method.sparsity import LambdaController

TARGET = 1 - 1 / 8  # E=8, k=1


def test_lambda_sequence_by_hand():
    ctl = LambdaController(target_sparsity=TARGET, lambda0=1e-8, alpha=1.2)
    assert ctl.coeff == 1e-8 and ctl.steps == 0
    #   S_i:   below target -> x1.2, above -> /1.2, equal -> unchanged
    sparsities = [0.5, 0.3, 0.95, 0.875, 0.99, 0.99, 0.0]
    expected = [1.2e-8, 1.44e-8, 1.2e-8, 1.2e-8, 1e-8, 1e-8 / 1.2, 1e-8]
    for i, (s, lam) in enumerate(zip(sparsities, expected)):
        returned = ctl.update(s)
        assert returned == pytest.approx(lam, rel=1e-12)
        assert ctl.coeff == returned  # the coefficient of the next step's loss
        assert ctl.steps == i + 1


def test_defaults_are_the_paper_values_and_target_comes_from_k_over_e():
    cfg = ReMoEConfig(num_experts=8, top_k=1)
    assert cfg.routing.target_sparsity == TARGET
    assert ReMoEConfig(num_experts=8, top_k=1, granularity=4,
                       ffn_hidden_size=1024).routing.target_sparsity == TARGET
    assert ReMoEConfig(num_experts=16, top_k=2).routing.target_sparsity == TARGET
    ctl = LambdaController(cfg.routing.target_sparsity, cfg.control.lambda0, cfg.control.alpha)
    assert (ctl.lambda0, ctl.alpha, ctl.coeff) == (1e-8, 1.2, 1e-8)
    assert LambdaController(TARGET).coeff == 1e-8


def test_lambda_grows_geometrically_while_too_dense():
    ctl = LambdaController(TARGET, lambda0=1e-8, alpha=1.2)
    for _ in range(100):
        ctl.update(0.0)
    assert ctl.coeff == pytest.approx(1e-8 * 1.2 ** 100, rel=1e-10)
    assert ctl.steps == 100


def test_tensor_sparsity_is_accepted():
    # MoEAux.sparsity is a 0-d tensor; the controller keeps a python float either way
    a, b = LambdaController(TARGET), LambdaController(TARGET)
    for s in (0.5, 0.9, 0.875):
        a.update(s)
        b.update(torch.tensor(s, dtype=torch.float64))
        assert isinstance(b.value, float) and b.value == a.value
    b.update(torch.tensor(0.1))
    assert b.value == pytest.approx(a.value * 1.2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_sparsity_is_rejected(bad):
    ctl = LambdaController(TARGET)
    with pytest.raises(ValueError, match="sparsity"):
        ctl.update(bad)
    assert ctl.coeff == 1e-8 and ctl.steps == 0  # unchanged


def test_state_dict_round_trip_resumes_the_same_sequence():
    run = [0.2, 0.6, 0.9, 0.875, 0.1, 0.95, 0.3, 0.4]
    straight = LambdaController(TARGET, lambda0=2e-8, alpha=1.5)
    values = [straight.update(s) for s in run]

    first = LambdaController(TARGET, lambda0=2e-8, alpha=1.5)
    for s in run[:3]:
        first.update(s)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # checkpoints use torch.load(weights_only=True)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    resumed = LambdaController(0.5, lambda0=1.0, alpha=3.0)  # deliberately different
    resumed.load_state_dict(state)
    assert resumed.steps == 3 and resumed.coeff == values[2]
    assert (resumed.target_sparsity, resumed.lambda0, resumed.alpha) == (TARGET, 2e-8, 1.5)
    assert [resumed.update(s) for s in run[3:]] == values[3:]
    assert resumed.state_dict() == straight.state_dict()
