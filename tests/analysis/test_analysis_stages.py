"""Stage detection and settling time on synthetic curves with hand-known answers."""

from __future__ import annotations

import numpy as np
import pytest

from remoe.method.stages import (band_excursions, centered_mean, detect_stages, mean_std_after,
                                 settle_index, trailing_mean)

TARGET = 1 - 1 / 8


def test_three_stage_curve_hand_values(synth):
    assert synth.TARGET == TARGET
    s = synth.sparsity_curve()
    steps = np.arange(1, s.size + 1)
    reg = np.where(steps >= 31, 0.1, 1e-6)  # lambda * L_reg: negligible before step 31
    lm = np.full(s.size, 4.0)  # threshold eps * L_lm = 0.004
    st = detect_stages(steps, s, TARGET, reg, lm, tol=0.01, window=10, eps=1e-3, smooth=1)
    assert st.stage2_start == synth.STAGE2_START == 31
    assert st.settle_step == synth.SETTLE_STEP == 61
    assert st.settling_time == 60  # steps 1..60 are stages I + II
    stage = st.stage_of(steps)
    assert (stage[:30] == 1).all() and (stage[30:60] == 2).all() and (stage[60:] == 3).all()


def test_stage_two_starts_when_regularisation_matters():
    # lambda_i = 1e-8 * 1.2^(i-1), L_reg = 2, L_lm = 4: R_i >= eps * 4 first at
    # i - 1 >= ln(2e5) / ln(1.2) = 66.95 -> step 68 (eps 1e-3); ln(2e6) / ln(1.2) = 79.6 -> 81
    steps = np.arange(1, 201)
    reg = 2e-8 * 1.2 ** (steps - 1.0)
    lm = np.full(200, 4.0)
    s = np.where(steps < 100, 0.5, TARGET)
    st = detect_stages(steps, s, TARGET, reg, lm, eps=1e-3, smooth=1, tol=0.01)
    assert (st.stage2_start, st.settle_step, st.settling_time) == (68, 100, 99)
    assert detect_stages(steps, s, TARGET, reg, lm, eps=1e-2, smooth=1, tol=0.01).stage2_start == 81
    # regularisation that only matters after settling: stage II is empty
    assert detect_stages(steps, s, TARGET, reg * 1e-6, lm, smooth=1, tol=0.01).stage2_start == 100


def test_window_requires_staying_in_band():
    # touches the band at steps 20-24 (5 records), leaves, then stays from step 50 on
    steps = np.arange(1, 101)
    s = np.full(100, 0.5)
    s[19:24] = TARGET
    s[49:] = TARGET + 0.005
    assert detect_stages(steps, s, TARGET, tol=0.01, window=10, smooth=1).settle_step == 50
    # settled means "stays in the band from there on": a shorter window does not make the
    # first visit (steps 20-24) count
    assert detect_stages(steps, s, TARGET, tol=0.01, window=5, smooth=1).settle_step == 50
    assert band_excursions(steps, s, TARGET, 0.01) == [(25, 49)]
    # a tighter band than the offset never settles
    st = detect_stages(steps, s, TARGET, tol=0.001, window=10, smooth=1)
    assert st.settle_step is None and st.settling_time is None and st.stage2_start is None


def test_steps_need_not_start_at_one():
    steps = np.arange(101, 201)  # a resumed log
    s = np.concatenate([np.linspace(0.3, 0.8, 40), np.full(60, TARGET)])
    st = detect_stages(steps, s, TARGET, tol=0.01, window=10, smooth=1)
    assert st.settle_step == 141 and st.settling_time == 40


def test_runs_without_adaptive_lambda():
    steps = np.arange(1, 201)
    # TopK: on target from the first step -> stages I and II empty
    st = detect_stages(steps, np.full(200, TARGET), TARGET, smooth=1, tol=0.01)
    assert (st.stage2_start, st.settle_step, st.settling_time) == (1, 1, 0)
    assert (st.stage_of(steps) == 3).all()
    # TopK with a k=6 warm-up for 100 steps: stage I is the warm-up, no stage II
    s = np.where(steps <= 100, 1 - 6 / 8, TARGET)
    st = detect_stages(steps, s, TARGET, np.zeros(200), np.full(200, 4.0), smooth=1, tol=0.01)
    assert (st.stage2_start, st.settle_step, st.settling_time) == (101, 101, 100)


def test_overshoot_has_no_dense_stage():
    # large lambda_0: regularisation matters at once, sparsity overshoots to 0.95, comes back
    s = np.concatenate([[0.5], np.full(10, 0.95), np.linspace(0.95, TARGET + 0.02, 18),
                        np.full(40, TARGET)])
    steps = np.arange(1, s.size + 1)
    st = detect_stages(steps, s, TARGET, np.full(s.size, 0.5), np.full(s.size, 4.0), smooth=1, tol=0.01)
    assert st.stage2_start == 1  # stage I empty
    assert st.settle_step == 30  # first of the 40 on-target records
    assert st.settling_time == 29


def test_settle_index_window_and_nan():
    s = np.array([0.0, 0.875, np.nan, 0.875, 0.875, 0.875])
    assert settle_index(s, 0.875, 0.01, 3) == 3
    assert settle_index(s, 0.875, 0.01, 4) is None
    assert settle_index(s[:2], 0.875, 0.01, 3) is None
    with pytest.raises(ValueError):
        settle_index(s, 0.875, 0.01, 0)


def test_smoothing_and_mean_std():
    assert np.allclose(trailing_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])
    assert np.allclose(centered_mean(np.array([1.0, 3.0, 5.0, 7.0]), 3), [2.0, 3.0, 5.0, 6.0])
    mean, std, n = mean_std_after(np.arange(1, 7), [9, 9, 1, 2, 3, np.nan], skip=2)
    assert n == 3 and mean == pytest.approx(2.0) and std == pytest.approx(np.sqrt(2 / 3))
    # smoothing removes an isolated one-step dip out of the band after settling
    steps = np.arange(1, 61)
    s = np.full(60, 0.5)
    s[30:] = TARGET
    s[45] = TARGET - 0.02
    assert detect_stages(steps, s, TARGET, window=1, smooth=1, tol=0.01).settle_step == 47
    assert detect_stages(steps, s, TARGET, window=1, smooth=3, tol=0.01).settle_step == 32


def test_settling_step_comes_after_the_last_excursion():
    # the case once reported: in the band from step 82, out of it for steps 93-115, in again
    # from 116 to the end (300 steps): the settling step is 116, not 82
    steps = np.arange(1, 301)
    s = np.where(steps < 82, 0.5, TARGET + 0.01)
    s[(steps >= 93) & (steps <= 115)] = TARGET - 0.05
    st = detect_stages(steps, s, TARGET, tol=0.02, window=10, smooth=1)
    assert st.settle_step == 116 and st.settling_time == 115
    assert band_excursions(steps, s, TARGET, 0.02) == [(93, 115)]
    assert (st.stage_of(steps)[(steps >= 93) & (steps <= 115)] < 3).all()
    # an excursion in the last records: not settled (yet)
    s2 = s.copy()
    s2[-3:] = 0.5
    assert detect_stages(steps, s2, TARGET, tol=0.02, window=10, smooth=1).settle_step is None
    assert band_excursions(steps, s2, TARGET, 0.02)[-1] == (298, 300)


def test_fixed_sparsity_has_no_settling_to_report(tmp_path):
    """A router that fixes k logs the same sparsity every step (``fixed``: the summary, the
    study tables and the report say n/a); a router whose sparsity a controller holds -- the
    lambda or, with no lambda, the thresholds -- reports its settling step like ReMoE's."""
    import json

    from remoe.lab.analysis.report import settling_cell
    from remoe.method.stages import sparsity_is_fixed
    from remoe.train.metrics import logged_stages

    steps = np.arange(1, 201)
    topk = detect_stages(steps, np.full(200, TARGET), TARGET, smooth=1, tol=0.01)
    assert topk.fixed and topk.reported_settle_step is None and topk.settle_step == 1
    assert sparsity_is_fixed([TARGET, np.nan, TARGET]) and not sparsity_is_fixed([np.nan])
    # a threshold router: no lambda, dense at first, on target from step 61 (noisy)
    rng = np.random.default_rng(0)
    s = np.where(steps <= 60, 0.5, TARGET) + rng.uniform(-0.005, 0.005, 200)
    thr = detect_stages(steps, s, TARGET, np.zeros(200), np.full(200, 4.0))
    assert not thr.fixed and thr.reported_settle_step == thr.settle_step
    assert 61 <= thr.settle_step <= 64 and thr.stage2_start == thr.settle_step  # no stage II
    assert settling_cell("relu_threshold", thr.to_dict()) == thr.settling_time
    assert settling_cell("topk", topk.to_dict()) == "n/a (sparsity fixed by the router)"
    assert settling_cell("topk", {}) == "n/a (sparsity fixed by the router)"  # older records
    # the trainer's end-of-run summary reads the same from metrics.jsonl
    for name, curve in (("topk", np.full(200, TARGET)), ("thr", s)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": int(i), "sparsity": float(v), "lambda": 0.0, "reg_loss": 0.0,
                        "lm_loss": 4.0}) + "\n" for i, v in zip(steps, curve)))
    assert logged_stages(tmp_path / "topk", TARGET) is None
    assert logged_stages(tmp_path / "thr", TARGET).settle_step == thr.settle_step
