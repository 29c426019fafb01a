"""A study run's full training config: its name, directory, seed and threads, its stop rule
(``steps`` / ``tokens`` / ``flops``, ``match_flops_of``), and validation through the experiment
loader (:func:`remoe.experiment.load_config`) before anything runs."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Iterable

from remoe.errors import ConfigError
from remoe.lab.study.runspec import RunSpec


def apply_stop(run: RunSpec, out_dir: Path, threads: int | None,
               match_flops: float | None = None) -> dict[str, dict[str, Any]]:
    """The run's full config: name, directory, seed, threads and its stop rule.

    ``steps``: ``train.max_steps``. ``tokens``: ``train.max_tokens`` and a schedule horizon
    ``max_steps = ceil(tokens / tokens per step)``. ``flops`` / ``match_flops_of``:
    ``train.max_flops`` and ``max_steps = ceil(flops / nominal FLOPs per step)`` (the run's
    k-sparse cost, :func:`remoe.lab.study.estimate.nominal_step_flops`), so that the cosine
    schedule ends where a sparse-cost run stops; a ReLU run, denser before it settles, reaches
    ``max_flops`` a little earlier. ``match_flops`` is the matched runs' FLOPs, summed (None
    before they finished: a placeholder of 1 FLOP keeps the config valid for checking).
    ``init_from_run``: ``train.init_from`` is that run's directory under ``out_dir``.
    """
    from remoe.lab.study.estimate import nominal_step_flops, tokens_per_step

    cfg = copy.deepcopy(run.config)
    cfg.setdefault("run", {}).update(name=run.name, out_dir=str(out_dir), seed=run.seed)
    if threads is not None:
        cfg.setdefault("train", {})["num_threads"] = threads
    stop = run.stop
    if run.match_of:
        stop = {"flops": float(match_flops) if match_flops else 1.0}
    if run.init_of is not None:  # init_from_run: the study run's directory (its final/)
        cfg.setdefault("train", {})["init_from"] = str(Path(out_dir) / run.init_of)
    if stop:
        (k, v), = stop.items()
        train = cfg.setdefault("train", {})
        if k == "steps":
            train["max_steps"] = int(v)
        elif k == "tokens":
            train["max_tokens"] = int(v)
            train["max_steps"] = max(1, math.ceil(v / tokens_per_step(cfg)))
        else:
            train["max_flops"] = float(v)
            train["max_steps"] = max(1, math.ceil(v / nominal_step_flops(cfg)))
    return cfg


def load_run_config(cfg: dict[str, dict[str, Any]]):
    """:func:`remoe.experiment.load_config` on a run's sections dict."""
    from remoe.experiment import load_config

    return load_config(cfg)


def validate_runs(runs: Iterable[RunSpec]) -> None:
    """Every expanded run's config through the experiment loader, before anything runs."""
    for r in runs:
        try:
            load_run_config(apply_stop(r, Path("study-check"), None, None))
        except ConfigError as e:
            raise ConfigError(f"study run {r.name} (group {r.group}): {e}") from None
