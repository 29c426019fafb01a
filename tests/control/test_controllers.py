"""Sparsity-control options: PI rule, per-layer lambdas, revival counters, state."""

from __future__ import annotations

import math

import pytest

from remoe import ReMoEConfig
from remoe.errors import ConfigError
from remoe.method.sparsity import (ExpertRevival, LambdaController, SparsityControl,
                                   build_controller, lambdas_in)


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


def test_per_layer_control_drives_each_layer_by_its_own_sparsity():
    lw = SparsityControl([LambdaController(0.75, 1.0, 2.0) for _ in range(3)], per_layer=True)
    lw.update(0.0, [0.5, 0.9, 0.75], [])  # too dense -> x2, too sparse -> /2, on target -> same
    assert lw.layer_coeffs == [2.0, 0.5, 1.0]
    assert lw.coeff == pytest.approx(3.5 / 3)
    assert lw.coeffs() == (lw.coeff, [2.0, 0.5, 1.0])
    with pytest.raises(ValueError):
        lw.update(0.0, [0.5, 0.5], [])
    with pytest.raises(ValueError, match="one lambda"):
        SparsityControl([LambdaController(0.75), LambdaController(0.75)])


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
    assert b.lams[0].prev_error == a.lams[0].prev_error
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


# controller state dicts exactly as earlier versions wrote them into trainer_state.pt (and
# ReMoETrainer into remoe_sparsity.json): they must keep loading
OLD_PAPER = {"target_sparsity": 0.75, "lambda0": 1e-08, "alpha": 1.2, "value": 3.5e-07,
             "steps": 17}
OLD_PI = {**OLD_PAPER, "rule": "pi", "kp": 1.0, "ki": 1.0, "prev_error": 0.25}
OLD_PER_LAYER_REVIVAL = {
    "lambda": {"per_layer": [
        {**OLD_PAPER, "value": 2e-07, "rule": "pi", "kp": 1.0, "ki": 1.0, "prev_error": -0.5},
        {**OLD_PAPER, "value": 4e-07, "rule": "pi", "kp": 1.0, "ki": 1.0, "prev_error": None}]},
    "revival": {"after": 3, "silent": [[0, 4, 0, 1], [2, 0, 0, 0]]}}
OLD_GLOBAL_REVIVAL = {"lambda": OLD_PAPER, "revival": {"after": 2, "silent": [[0, 3, 0, 0]]}}


def test_controller_state_of_earlier_versions_loads():
    paper = build_controller(ReMoEConfig.from_preset("micro", num_experts=4), 2)
    paper.load_state_dict(dict(OLD_PAPER))
    assert paper.coeffs() == (3.5e-07, None) and paper.lams[0].steps == 17
    assert paper.state_dict() == OLD_PAPER  # and is written back the same way

    pi = build_controller(ReMoEConfig.from_preset("micro", num_experts=4, lambda_update="pi"), 2)
    pi.load_state_dict(dict(OLD_PI))
    assert pi.lams[0].prev_error == 0.25 and pi.state_dict() == OLD_PI

    cfg = ReMoEConfig.from_preset("micro", num_experts=4, sparsity_control="per_layer",
                                  lambda_update="pi", revive_after=3)
    per_layer = build_controller(cfg, 2)
    per_layer.load_state_dict(OLD_PER_LAYER_REVIVAL)
    assert per_layer.layer_coeffs == [2e-07, 4e-07]
    assert [c.prev_error for c in per_layer.lams] == [-0.5, None]
    assert per_layer.revival.silent == [[0, 4, 0, 1], [2, 0, 0, 0]]
    assert per_layer.dead_experts() == [[False, True, False, False], [False, False, False, False]]
    assert per_layer.state_dict() == OLD_PER_LAYER_REVIVAL
    masks = per_layer.revive_masks()  # the hinge's input to the next forward
    assert masks[0].tolist() == [False, True, False, False] and masks[1] is None

    one = build_controller(ReMoEConfig.from_preset("micro", num_experts=4, revive_after=2), 1)
    one.load_state_dict(OLD_GLOBAL_REVIVAL)
    assert one.coeff == 3.5e-07 and one.dead_experts() == [[False, True, False, False]]
    assert one.state_dict() == OLD_GLOBAL_REVIVAL
    with pytest.raises(ValueError, match="per-layer lambda state"):
        one.load_state_dict(OLD_PER_LAYER_REVIVAL)

    assert lambdas_in(OLD_PAPER) == [3.5e-07]
    assert lambdas_in(OLD_GLOBAL_REVIVAL) == [3.5e-07]
    assert lambdas_in(OLD_PER_LAYER_REVIVAL) == [2e-07, 4e-07]


def test_lambda_update_rules_are_the_model_configs():
    from remoe.model.spec import LAMBDA_UPDATES

    for rule in LAMBDA_UPDATES:
        LambdaController(0.75, rule=rule)
    with pytest.raises(ValueError, match="rule='bang'"):
        LambdaController(0.75, rule="bang")
