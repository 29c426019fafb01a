"""What every analysis of :mod:`remoe.lab.analysis.analyze` shares: the analysis names, the
:class:`Options`, :class:`Skip`, the CSV / JSON writers of their numbers, and when an expert
counts as inactive (:func:`inactive_threshold`).

An expert is inactive below a share of the tokens routed to it. ``fair`` (the default): below a
quarter of its fair share, the routed-tokens ratio ``k/E`` every expert has under perfect
balance at the target density (``k*G`` active of ``N = E*G`` experts; ``1/(4E)`` for k = 1).
Relative to E, so a balanced expert is never flagged whatever E is. ``paper``: below 1/64 of the
tokens, the paper's Fig. 7 ("inactive experts with fewer than 1/64 tokens routed"), kept to
reproduce it; at E >= 64 it flags experts that carry their fair share.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remoe.errors import ConfigError
from remoe.method.stages import SETTLE_TOL, SETTLE_WINDOW, SMOOTH, STAGE_EPS

LOG_ANALYSES = ("stages", "sparsity", "flips", "experts")
MODEL_ANALYSES = ("heatmap", "specialization", "allocation")
#: model-based, from a pass of their own (remoe.lab.analysis.gates), not from routing_stats.npz
HOOK_ANALYSES = ("gates",)
ANALYSES = LOG_ANALYSES + MODEL_ANALYSES + HOOK_ANALYSES
STATS_FILE = "routing_stats.npz"
INACTIVE_RULES = ("fair", "paper")
#: the default rule: inactive below this fraction of the fair share k/E
FAIR_SHARE_FRACTION = 0.25
#: the paper's rule (Fig. 7)
PAPER_INACTIVE_RATIO = 1.0 / 64


@dataclass
class Options:
    what: tuple[str, ...] = ANALYSES
    checkpoint: str | None = None  # model for the model-based analyses (default: the run's)
    data: str = "auto"  # see remoe.lab.analysis.model_analyses.eval_tokens
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
    inactive_rule: str = "fair"  # inactive_threshold: fair (default) or paper (1/64)
    mask_step: int | None = None  # experts (and domains): the recorded step (None: the last)
    compare: list[str] = field(default_factory=list)


class Skip(Exception):
    """An analysis that cannot run on this run (the message says why)."""


def inactive_threshold(fair_ratio: float, rule: str = "fair") -> float:
    """The routed-tokens ratio under which an expert is inactive; ``fair_ratio`` = k/E
    (= 1 - target sparsity)."""
    if rule == "paper":
        return PAPER_INACTIVE_RATIO
    if rule != "fair":
        raise ConfigError(f"inactive_rule={rule!r} must be one of {', '.join(INACTIVE_RULES)}")
    if not fair_ratio > 0:
        raise ConfigError(f"the fair share k/E={fair_ratio!r} must be > 0")
    return FAIR_SHARE_FRACTION * fair_ratio


def rule_text(rule: str = "fair") -> str:
    """The rule in a few words, for table headers and captions."""
    return "< 1/4 of the fair share k/E of tokens" if rule == "fair" else "< 1/64 of tokens"


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
