"""Expert use of a run, per MoE layer, from its files (``remoe analyze experts``, the study
tables' "Expert use"; definitions in docs/ANALYSIS.md).

* From ``metrics.jsonl(.gz)`` ``expert_counts`` of the last 10% of the logged steps (at least
  one), each step's statistics as the trainer logs them
  (:func:`remoe.method.sparsity.step_statistics`: ``layer_active_k``, ``effective_experts``,
  ``dead_experts``), averaged over those steps:
  ``experts_per_token``, ``effective_experts``, ``never_firing``.
* From the last recorded calibration-set routing masks (``routing/masks_*.npz`` or the committed
  ``routing.zip``): ``no_expert_share`` (tokens routed to no expert) and ``inactive`` (experts
  under :func:`remoe.lab.analysis.common.inactive_threshold` of the tokens).

Legend: L MoE layers, N experts, S steps, T calibration tokens.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from remoe.lab.analysis.common import inactive_threshold
from remoe.lab.analysis.runlog import Run
from remoe.model.losses import no_expert_share_of
from remoe.method.sparsity import step_statistics

TAIL_FRACTION = 0.1  # the last 10% of the logged steps
TRAIN_KEYS = ("experts_per_token", "effective_experts", "never_firing")
CALIB_KEYS = ("no_expert_share", "inactive")


def training_use(records: list[dict[str, Any]], tail: float = TAIL_FRACTION
                 ) -> dict[str, Any] | None:
    """Per-layer means over the last ``tail`` of the records that carry ``expert_counts``
    (None without any)."""
    recs = [r for r in records if isinstance(r.get("expert_counts"), list)
            and r["expert_counts"] and (r.get("step_tokens") or 0) > 0]
    if not recs:
        return None
    window = recs[len(recs) - max(1, math.ceil(tail * len(recs))):]
    per_step = []
    for r in window:
        st = step_statistics(torch.tensor(r["expert_counts"], dtype=torch.float64),
                             float(r["step_tokens"]))
        per_step.append([st.layer_active_k, st.effective_experts, st.dead_experts])
    if len({len(p[0]) for p in per_step}) != 1:
        return None  # the layer count changed within the window: no per-layer mean
    mean_KL = np.asarray(per_step, dtype=np.float64).mean(axis=0)
    return {**{k: mean_KL[i].tolist() for i, k in enumerate(TRAIN_KEYS)},
            "steps": [int(window[0].get("step", -1)), int(window[-1].get("step", -1))],
            "num_steps": len(window)}


def calibration_use(masks_LTN: np.ndarray, fair_ratio: float, rule: str = "fair"
                    ) -> dict[str, Any]:
    """No-expert share and inactive experts per layer of one calibration pass."""
    ratio_LN = masks_LTN.mean(axis=1)
    return {"no_expert_share": no_expert_share_of(masks_LTN).tolist(),
            "inactive": (ratio_LN < inactive_threshold(fair_ratio, rule)).sum(1).tolist(),
            "num_tokens": int(masks_LTN.shape[1]), "num_experts": int(masks_LTN.shape[2])}


def run_expert_use(run: Run, rule: str = "fair", step: int | None = None
                   ) -> dict[str, Any] | None:
    """``{"train": training_use | None, "calib": calibration_use + "step" | None, "rule"}``;
    None for a run without routed experts or without either source. ``step``: the run as it
    was at that recorded step (the training window ends there, the masks are that step's;
    runs cut at different steps compare there), else at its end."""
    target = run.target_sparsity
    if target is None or not 1.0 - target > 0:
        return None
    records = run.metrics.records
    if step is not None:
        records = [r for r in records if int(r.get("step", -1)) <= step]
    train = training_use(records)
    calib = None
    last = run.last_masks(step)
    if last is not None:
        calib = {**calibration_use(last[1], 1.0 - target, rule), "step": int(last[0])}
    if train is None and calib is None:
        return None
    return {"train": train, "calib": calib, "rule": rule}


def layer_rows(use: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per layer (``layer`` plus every key of both sources; None where missing)."""
    train, calib = use.get("train") or {}, use.get("calib") or {}
    L = max(len(train.get("experts_per_token", [])), len(calib.get("inactive", [])))
    return [{"layer": l, **{k: _at(train.get(k), l) for k in TRAIN_KEYS},
             **{k: _at(calib.get(k), l) for k in CALIB_KEYS}} for l in range(L)]


def _at(values: list | None, i: int) -> Any:
    return values[i] if values is not None and i < len(values) else None
