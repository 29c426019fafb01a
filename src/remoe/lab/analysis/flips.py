"""Routing stability (Appendix A): flip rate and flip count between recorded routing masks.

For masks M_i^l in {0,1}^{T x N} of every MoE layer l on the run's fixed calibration set:

    flip rate_i  = sum_l || vec(M_i^l - M_{i-1}^l) ||_1 / (L * T * N)
    flip count_i = N * flip rate_i

N is the number of routed experts E*G. ``i-1`` is the previous *recorded* mask, so with
``analysis.record_masks_every = r`` a point measures the change over r optimizer steps
(the paper records every step; the gap is kept in the CSV as ``step_gap``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from remoe.lab.analysis.runlog import load_masks


def flip_rate(prev_LTN: np.ndarray, cur_LTN: np.ndarray) -> float:
    """Fraction of (layer, token, expert) activation states that differ."""
    prev, cur = np.asarray(prev_LTN, dtype=bool), np.asarray(cur_LTN, dtype=bool)
    if prev.shape != cur.shape:
        raise ValueError(f"mask shapes differ: {prev.shape} vs {cur.shape}")
    return float(np.count_nonzero(prev ^ cur)) / max(prev.size, 1)


def layer_flip_rates(prev_LTN: np.ndarray, cur_LTN: np.ndarray) -> np.ndarray:
    """[L] flip rate of each layer."""
    x = np.asarray(prev_LTN, dtype=bool) ^ np.asarray(cur_LTN, dtype=bool)
    return x.reshape(x.shape[0], -1).mean(1)


@dataclass
class FlipSeries:
    """Flip rates between consecutive recorded masks of one run."""

    num_experts: int = 0  # N
    steps: list[int] = field(default_factory=list)  # the later step of each pair
    prev_steps: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    layer_rates: list[list[float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why a pair was not compared

    @property
    def counts(self) -> list[float]:
        return [self.num_experts * r for r in self.rates]

    def rows(self) -> list[dict]:
        out = []
        for a, b, r, lr in zip(self.prev_steps, self.steps, self.rates, self.layer_rates):
            row = {"step": b, "prev_step": a, "step_gap": b - a, "flip_rate": r,
                   "flip_count": self.num_experts * r}
            row.update({f"flip_rate_layer{l}": v for l, v in enumerate(lr)})
            out.append(row)
        return out


def flip_series(mask_files: list[tuple[int, Path]]) -> FlipSeries:
    """Flip rates over a run's ``(step, masks_<step>.npz)`` files (sorted by step).

    A pair is skipped (and said why) when the calibration tokens or the mask shapes differ.
    Only two mask files are held in memory at a time.
    """
    series = FlipSeries()
    prev = None
    for step, path in mask_files:
        masks, tokens, _ = load_masks(path)
        series.num_experts = int(masks.shape[-1])
        if prev is not None:
            pstep, pmasks, ptokens = prev
            if pmasks.shape != masks.shape:
                series.skipped.append(f"steps {pstep}->{step}: mask shape {pmasks.shape} -> "
                                      f"{masks.shape}")
            elif not np.array_equal(ptokens, tokens):
                series.skipped.append(f"steps {pstep}->{step}: calibration tokens differ")
            else:
                series.prev_steps.append(pstep)
                series.steps.append(step)
                series.rates.append(flip_rate(pmasks, masks))
                series.layer_rates.append(layer_flip_rates(pmasks, masks).tolist())
        prev = (step, masks, tokens)
    return series
