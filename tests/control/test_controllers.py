"""Sparsity-control options: PI rule, per-layer lambdas, revival counters, state."""

from __future__ import annotations

import math

import pytest

from remoe import ReMoEConfig
from remoe.errors import ConfigError
from remoe.method.sparsity import (ExpertRevival, LambdaController, LayerwiseLambdaController,
                                   SparsityControl, build_controller)


def test_pi_rule_on_a_hand_computed_sequence():
    # target density k/E = 0.25; kp = 1, ki = 0.25; alpha = 2 so log2(lambda) is the exponent
    c = LambdaController(0.75, lambda0=1.0, alpha=2.0, rule="pi", kp=1.0, ki=0.25)
    c.update(0.5)  # e = (0.5 - 0.25)/0.25 = 1; first step: no change term -> 0.25 * 1
    assert math.log2(c.coeff) == pytest.approx(0.25)
    c.update(0.7)  # e = 0.2: (0.2 - 1) + 0.25 * 0.2 = -0.75
    assert math.log2(c.coeff) == pytest.approx(-0.5)
    c.update(0.0)  # e = 3: 2.8 + 0.75 = 3.55 -> clipped to one full alpha step
    assert math.log2(c.coeff) == pytest.approx(0.5)
    c.update(1.0)  # e = -1: (-1 - 3) - 0.25 -> clipped to -1
    assert math.log2(c.coeff) == pytest.approx(-0.5)
    assert c.steps == 4


def test_pi_rule_saturates_like_the_sign_rule_far_from_target():
    sign = LambdaController(1 - 1 / 32, lambda0=1e-8, alpha=1.2)
    pi = LambdaController(1 - 1 / 32, lambda0=1e-8, alpha=1.2, rule="pi")
    for _ in range(20):  # stage I: a dense model, density 1 vs target 1/32
        sign.update(0.0)
        pi.update(0.0)
    assert pi.coeff == pytest.approx(sign.coeff, rel=1e-12)


def test_pi_rule_step_shrinks_with_the_error_near_target():
    c = LambdaController(0.875, lambda0=1.0, alpha=1.2, rule="pi", kp=0.0, ki=0.25)
    c.update(0.875 - 0.125 * 0.04)  # density 4% above target -> e = 0.04 -> 0.01 of a step
    assert math.log(c.coeff) / math.log(1.2) == pytest.approx(0.01)


def test_sign_rule_unchanged_and_checkpoint_format_unchanged():
    c = LambdaController(0.875, lambda0=1e-8, alpha=1.2)
    for s in (0.1, 0.9, 0.5):
        c.update(s)
    assert c.coeff == 1e-8 * 1.2 * (1 / 1.2) * 1.2
    assert set(c.state_dict()) == {"target_sparsity", "lambda0", "alpha", "value", "steps"}


def test_layerwise_controller_drives_each_layer_by_its_own_sparsity():
    lw = LayerwiseLambdaController([LambdaController(0.75, 1.0, 2.0) for _ in range(3)])
    lw.update([0.5, 0.9, 0.75])  # too dense -> x2, too sparse -> /2, on target -> unchanged
    assert lw.coeffs == [2.0, 0.5, 1.0]
    assert lw.coeff == pytest.approx(3.5 / 3)
    with pytest.raises(ValueError):
        lw.update([0.5, 0.5])


def test_revival_counts_consecutive_silent_steps():
    r = ExpertRevival(after=2)
    assert r.update([[0, 5], [3, 0]]) == [[False, False], [False, False]]
    assert r.update([[0, 5], [1, 0]]) == [[True, False], [False, True]]
    assert r.update([[4, 0], [0, 0]]) == [[False, False], [False, True]]
    assert r.silent == [[0, 1], [1, 3]]


def test_revival_below_a_share_of_the_steps_tokens_counts_as_starving():
    r = ExpertRevival(after=2, below=1 / 64)  # 128 tokens: at most 2 tokens is starving
    assert r.update([[2, 126], [3, 125]], 128) == [[False, False], [False, False]]
    assert r.update([[1, 127], [2, 126]], 128) == [[True, False], [False, False]]
    assert r.update([[3, 125], [0, 128]], 128) == [[False, False], [True, False]]
    assert r.silent == [[0, 0], [2, 0]] and r.dead() == [[False, False], [True, False]]
    with pytest.raises(ValueError, match="token count"):
        r.update([[1, 1], [1, 1]])
    # through the config: the controller feeds the step's tokens
    cfg = ReMoEConfig.from_preset("micro", num_experts=2, revive_after=1, revive_below=0.25)
    c = build_controller(cfg, 1)
    c.update(0.5, [0.5], [[3, 13]], 16)
    assert c.dead_experts() == [[True, False]]
    with pytest.raises(ConfigError, match="model.revive_below=1.5 must be a number in"):
        ReMoEConfig.from_preset("micro", revive_below=1.5)


def test_revival_until_keeps_a_revived_expert_dead_until_it_reaches_that_share():
    # 128 tokens: starving at <= 2 tokens (1/64); released at >= 16 tokens (1/8)
    r = ExpertRevival(after=2, below=1 / 64, until=1 / 8)
    seq = [([[1]], False), ([[2]], True),   # two starving steps: dead
           ([[3]], True), ([[15]], True),   # above `below` but under `until`: still dead
           ([[16]], False),                 # at `until`: released, streak reset
           ([[3]], False), ([[0]], False)]  # alive again: 3 is not starving, 0 starts a streak
    for counts, dead in seq:
        assert r.update(counts, 128) == [[dead]]
    assert r.silent == [[1]]
    # without `until` the same sequence releases the expert at the first step above `below`
    plain = ExpertRevival(after=2, below=1 / 64)
    assert [plain.update(c, 128)[0][0] for c, _ in seq] == [False, True, False, False, False,
                                                            False, False]
    cfg = ReMoEConfig.from_preset("micro", num_experts=2, revive_after=1, revive_below=0.25,
                                  revive_until=0.5)
    c = build_controller(cfg, 1)
    c.update(0.5, [0.5], [[3, 13]], 16)
    c.update(0.5, [0.5], [[6, 10]], 16)  # 6/16 > 1/4 but < 1/2: still under revival
    assert c.dead_experts() == [[True, False]]
    with pytest.raises(ConfigError, match=r"model.revive_until=0.1 must be 0 \(off\) or a share"):
        ReMoEConfig.from_preset("micro", revive_below=0.25, revive_until=0.1)


def test_sparsity_control_state_round_trip_and_format_guard():
    cfg = ReMoEConfig.from_preset("micro", num_experts=4, sparsity_control="per_layer",
                                  lambda_update="pi", revive_after=3)
    a = build_controller(cfg, 2)
    for s, ls, counts in [(0.5, [0.4, 0.6], [[1, 0, 2, 0], [0, 0, 1, 1]]),
                          (0.7, [0.8, 0.6], [[0, 0, 2, 0], [1, 0, 1, 1]])]:
        a.update(s, ls, counts)
    b = build_controller(cfg, 2)
    b.load_state_dict(a.state_dict())
    assert b.layer_coeffs == a.layer_coeffs and b.revival.silent == a.revival.silent
    assert b.lam.layers[0].prev_error == a.lam.layers[0].prev_error
    paper = build_controller(ReMoEConfig.from_preset("micro", num_experts=4), 2)
    assert isinstance(paper, SparsityControl) and paper.layer_coeffs is None
    assert set(paper.state_dict()) == {"target_sparsity", "lambda0", "alpha", "value", "steps"}
    with pytest.raises(ValueError):
        paper.load_state_dict(a.state_dict())
    with pytest.raises(ValueError):
        b.load_state_dict(paper.state_dict())
    assert build_controller(ReMoEConfig.from_preset("micro", router="topk"), 2) is None


def test_lambda_floor_bounds_the_fall_and_is_off_by_default():
    """model.lambda_floor: a layer held sparser than its target drives lambda down without
    bound (1e-30); with a floor it stops there and climbs back from it."""
    cfg = ReMoEConfig.from_preset("micro", num_experts=8, sparsity_control="per_layer",
                                  lambda_update="pi", lambda0=1e-3)
    free = build_controller(cfg, 2)
    floored = build_controller(ReMoEConfig.from_preset(
        "micro", num_experts=8, sparsity_control="per_layer", lambda_update="pi", lambda0=1e-3,
        lambda_floor=1e-6), 2)
    for _ in range(400):  # layer 0 far too sparse, layer 1 on target
        for c in (free, floored):
            c.update(0.0, [0.99, 0.875], None)
    assert free.layer_coeffs[0] < 1e-25
    assert floored.layer_coeffs[0] == 1e-6
    assert free.layer_coeffs[1] == floored.layer_coeffs[1]  # a layer on target: untouched
    for _ in range(10):  # the layer turns dense: the floored lambda climbs from 1e-6
        floored.update(0.0, [0.5, 0.875], None)
    assert floored.layer_coeffs[0] == pytest.approx(1e-6 * 1.2 ** 10)
    with pytest.raises(ConfigError, match="model.lambda_floor=-1"):
        ReMoEConfig.from_preset("micro", lambda_floor=-1.0)
