"""What every analysis of :mod:`remoe.lab.analysis.analyze` shares: the analysis names, the
:class:`Options`, :class:`Skip`, and the CSV / JSON writers of their numbers."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remoe.method.stages import SETTLE_TOL, SETTLE_WINDOW, SMOOTH, STAGE_EPS

LOG_ANALYSES = ("stages", "sparsity", "flips", "experts")
MODEL_ANALYSES = ("heatmap", "specialization", "allocation")
#: model-based, from a pass of their own (remoe.lab.analysis.gates), not from routing_stats.npz
HOOK_ANALYSES = ("gates",)
ANALYSES = LOG_ANALYSES + MODEL_ANALYSES + HOOK_ANALYSES
STATS_FILE = "routing_stats.npz"


@dataclass
class Options:
    what: tuple[str, ...] = ANALYSES
    checkpoint: str | None = None  # model for the model-based analyses (default: the run's)
    data: str = "auto"  # see remoe.lab.analysis.evaldata
    data_cache: str | None = None
    max_tokens: int = 65536
    batch_size: int = 8
    layers: list[int] | None = None  # default first, middle, last
    min_count: int = 5  # Table 10 / Fig. 6 token filter
    top_tokens: int = 8
    settle_tol: float = SETTLE_TOL
    settle_window: int = SETTLE_WINDOW
    stage_eps: float = STAGE_EPS  # stage II: lambda * L_reg >= eps * L_lm
    smooth: int = SMOOTH
    skip_steps: int = 100  # Fig. 3: mean/std exclude the first steps
    recompute: bool = False  # ignore a cached routing_stats.npz
    inactive_rule: str = "fair"  # remoe.lab.analysis.inactive: fair (default) or paper (1/64)
    mask_step: int | None = None  # experts (and domains): the recorded step (None: the last)
    compare: list[str] = field(default_factory=list)


class Skip(Exception):
    """An analysis that cannot run on this run (the message says why)."""


# ----------------------------------------------------------------------------- small helpers

def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in r.items()})
    return path


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(obj), indent=2) + "\n")
    return path


def _fmt(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return "" if not math.isfinite(v) else f"{float(v):.6g}"
    return v


def json_safe(o: Any) -> Any:
    """JSON-safe: numpy -> python, NaN/inf -> null."""
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if isinstance(o, np.ndarray):
        return json_safe(o.tolist())
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, Path):
        return str(o)
    return o


def rel_files(paths: list[Path], out: Path) -> list[str]:
    return [str(p.relative_to(out)) if p.is_relative_to(out) else str(p) for p in paths]
