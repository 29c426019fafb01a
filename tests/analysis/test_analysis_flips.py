"""Flip rate / flip count (Appendix A) on hand-made masks in the trainer's file format."""

from __future__ import annotations

import numpy as np
import pytest

from remoe.lab.analysis.analyze import flip_rate, flip_series, layer_flip_rates
from remoe.lab.analysis.runlog import load_masks


def _masks(L=2, T=16, N=12, seed=0):
    return np.random.default_rng(seed).random((L, T, N)) < 0.3


def test_identical_and_complementary_masks():
    m = _masks()
    assert flip_rate(m, m) == 0.0
    assert flip_rate(m, ~m) == 1.0
    assert np.array_equal(layer_flip_rates(m, ~m), [1.0, 1.0])


def test_hand_counted_flips():
    prev = np.zeros((2, 3, 4), dtype=bool)  # L=2, T=3, N=4: 24 states
    cur = prev.copy()
    cur[0, 0, 1] = True  # on
    cur[1, 2, 3] = True  # on
    prev[1, 1, 0] = True  # off (was on, now off)
    assert flip_rate(prev, cur) == pytest.approx(3 / 24)
    assert np.allclose(layer_flip_rates(prev, cur), [1 / 12, 2 / 12])
    with pytest.raises(ValueError):
        flip_rate(prev, cur[:, :2])


def test_series_from_files_counts_and_skips(tmp_path, synth):
    N = 12  # not a multiple of 8: packbits padding must not count
    m = _masks(N=N)
    tokens = np.arange(16)
    files = []
    for step, masks in ((0, m), (10, m), (20, ~m)):
        p = tmp_path / f"masks_{step:07d}.npz"
        synth.save_masks(p, masks, tokens, step)
        files.append((step, p))
    back, tok, step = load_masks(files[2][1])
    assert back.shape == m.shape and np.array_equal(back, ~m) and step == 20
    s = flip_series(files)
    assert s.num_experts == N
    assert s.steps == [10, 20] and s.prev_steps == [0, 10]
    assert s.rates == [0.0, 1.0]
    assert s.counts == [0.0, float(N)]  # complementary masks: flip count = N
    rows = s.rows()
    assert rows[1]["step_gap"] == 10 and rows[1]["flip_count"] == N
    # another calibration set cannot be compared
    p = tmp_path / "masks_0000030.npz"
    synth.save_masks(p, ~m, tokens + 1, 30)
    s2 = flip_series(files + [(30, p)])
    assert len(s2.rates) == 2 and "calibration tokens differ" in s2.skipped[0]
