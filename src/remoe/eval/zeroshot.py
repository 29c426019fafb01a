"""Running task sets through lm-eval's evaluator, offline, and the paper-style results table.

:func:`plan_tasks` turns a ``--tasks`` selection (``builtin``, ``paper``, ``none`` or names,
comma-separated and mixable) into a :class:`TaskPlan`: what will run (built-in task names,
standard task configs with their local data) and what is skipped and why.
:func:`run_tasks` evaluates one model on a plan with ``lm_eval.simple_evaluate`` and returns
``{task: {metric: value}}``. :func:`zero_shot_table` renders one row per model, one column per
task and the average, in Markdown, as Table 2 of the paper does.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from remoe.eval.builtin_tasks import BUILTIN_TASKS, DOMAIN, HELLASWAG, LAMBADA
from remoe.eval.fit import fit_tasks
from remoe.eval.offline import force_offline
from remoe.eval.standard import PAPER_TASK_NAMES, StandardTask, resolve_standard_tasks

log = logging.getLogger("remoe.eval")

#: display column and headline metric of the built-in tasks (MI = acc_mutual_info: the
#: candidate whose likelihood the context raises most; see docs/EVAL.md)
BUILTIN_COLUMNS = {LAMBADA: ("LAMBADA* (acc)", "acc"),
                   HELLASWAG: ("HellaSwag* (MI)", "acc_mutual_info"),
                   DOMAIN: ("Domain* (MI)", "acc_mutual_info")}


@dataclass
class TaskPlan:
    """What to run: built-in tasks (from ``builtin_dir``), standard ones, and the skipped."""

    builtin: list[str] = field(default_factory=list)
    builtin_dir: Path | None = None
    standard: list[StandardTask] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def columns(self) -> list[tuple[str, str, str]]:
        """``(task, column, metric)`` of every requested task, runnable or not, in order."""
        cols = [(t, *BUILTIN_COLUMNS[t]) for t in self.builtin]
        cols += [(s.name, s.column, s.metric) for s in self.standard]
        return cols

    @property
    def runnable(self) -> list[Any]:
        """Task specs for ``simple_evaluate``: built-in names and standard configs."""
        return ([t for t in self.builtin if t not in self.skipped]
                + [s.config for s in self.standard if s.config is not None])


def parse_task_selection(spec: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """``(builtin tasks, standard tasks)`` from ``builtin``/``paper``/``none``/names."""
    items = [spec] if isinstance(spec, str) else list(spec)
    names = [x.strip() for s in items for x in s.split(",") if x.strip()]
    builtin: list[str] = []
    standard: list[str] = []
    for n in names:
        group = (list(BUILTIN_TASKS) if n == "builtin" else list(PAPER_TASK_NAMES) if n == "paper"
                 else [] if n == "none" else [n])
        for t in group:
            target = builtin if t in BUILTIN_TASKS else standard
            if t not in target:
                target.append(t)
    return builtin, standard


def plan_tasks(spec: str | Sequence[str], builtin_dir: Callable[[list[str]], tuple[Path | None, dict[str, str]]] | None = None,
               task_data_dir: str | Path | None = None) -> TaskPlan:
    """Resolve a task selection. ``builtin_dir(names)`` builds the built-in tasks and returns
    ``(task dir or None, {task: reason skipped})``; standard tasks get their local data."""
    builtin, standard = parse_task_selection(spec)
    plan = TaskPlan(builtin=builtin)
    if builtin:
        if builtin_dir is None:
            plan.skipped.update({t: "no held-out data to build it from" for t in builtin})
        else:
            plan.builtin_dir, skipped = builtin_dir(builtin)
            plan.skipped.update(skipped)
    if standard:
        plan.standard = resolve_standard_tasks(standard, task_data_dir)
        plan.skipped.update({s.name: s.missing for s in plan.standard if s.missing})
    return plan


def _metric_value(values: dict[str, Any], metric: str) -> float | None:
    v = values.get(f"{metric},none", values.get(metric))
    return float(v) if isinstance(v, (int, float)) else None


class _Quiet(logging.Filter):
    """Hides (and counts) lm-eval warnings that are noise here: HFLM's one warning per
    request cut to the model's length, and the hint printed for every ``custom_dataset``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "exceeds model's maximum length" in msg:
            self.count += 1
            return False
        return "Custom kwargs can be passed to `--metadata`" not in msg


def _git_describe() -> str | None:
    """lm-eval's record of the working directory's git commit, without git's "fatal: not a
    git repository" on stderr outside a repository (None there, or without git)."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                             check=False)
    except OSError:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@contextlib.contextmanager
def _quiet_git_hash():
    """For one ``simple_evaluate`` call: its ``git_hash`` from :func:`_git_describe` (lm-eval's
    own lets git print to the terminal)."""
    import lm_eval.evaluator as ev

    saved = ev.get_git_commit_hash
    ev.get_git_commit_hash = _git_describe
    try:
        yield
    finally:
        ev.get_git_commit_hash = saved


def run_tasks(lm: Any, plan: TaskPlan, limit: int | None = None,
              log_samples: bool = False) -> dict[str, Any]:
    """Evaluate ``lm`` (an lm-eval LM) on the runnable tasks of ``plan``.

    Every task is first fitted to the model's context (:func:`remoe.eval.fit.fit_tasks`).
    Returns ``{"results": {task: {metric: value}}, "n_samples": {task: n}, "truncated":
    requests cut from the left to fit the model, "skipped": {task: examples whose continuation
    alone does not fit}, "samples": {...} (with log_samples)}``.
    """
    force_offline()
    import datasets
    import lm_eval
    from lm_eval.tasks import TaskManager

    datasets.disable_progress_bars()
    specs = plan.runnable
    if not specs:
        return {"results": {}, "n_samples": {}, "truncated": 0, "skipped": {}}
    include = [str(plan.builtin_dir)] if plan.builtin_dir is not None else None
    tm = TaskManager(include_path=include, include_defaults=False)
    counter = _Quiet()
    loggers = [logging.getLogger(n) for n in ("lm_eval.models.huggingface", "lm_eval.api.task")]
    for lg in loggers:
        lg.addFilter(counter)
    try:
        objs: list[Any] = []
        for spec in specs:  # built here so that they can be fitted to the model's context
            loaded = tm.load([spec])
            group = loaded["groups"].get(spec) if isinstance(spec, str) else None
            objs.extend([group] if group is not None else loaded["tasks"].values())
        objs, fit = fit_tasks(lm, objs)
        with _quiet_git_hash():
            out = lm_eval.simple_evaluate(model=lm, tasks=objs, task_manager=tm, limit=limit,
                                          bootstrap_iters=0, log_samples=log_samples,
                                          confirm_run_unsafe_code=False)
    finally:
        for lg in loggers:
            lg.removeFilter(counter)
    if counter.count:
        log.warning("%d requests were longer than the model's maximum length (%s tokens) and "
                    "were cut from the left", counter.count, getattr(lm, "max_length", "?"))
    results: dict[str, dict[str, float]] = {}
    for task, values in (out or {}).get("results", {}).items():
        results[task] = {k.split(",")[0]: float(v) for k, v in values.items()
                         if "," in k and "stderr" not in k and isinstance(v, (int, float))}
    n = {t: int(v.get("effective", v.get("original", 0)) if isinstance(v, dict) else v)
         for t, v in (out or {}).get("n-samples", {}).items()}
    res: dict[str, Any] = {"results": results, "n_samples": n, "truncated": counter.count,
                           "skipped": fit.skipped}
    if log_samples:
        res["samples"] = (out or {}).get("samples", {})
    return res


def _fmt(v: float | None, pct: bool = True) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{100 * v:.2f}" if pct else f"{v:.3f}"


def zero_shot_table(rows: list[tuple[str, dict[str, dict[str, float]]]],
                    columns: list[tuple[str, str, str]]) -> str:
    """Markdown: one row per model, one column per task (metric in %), then ``Avg.``.

    ``rows``: ``(model name, {task: {metric: value}})``; ``columns``: ``(task, header,
    metric)``. A task without a value shows "–"; ``Avg.`` is the mean over the tasks the row
    has (marked with the count when some are missing).
    """
    head = ["Model"] + [c for _, c, _ in columns] + ["Avg."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + [":---:"] * (len(head) - 1)) + "|"]
    for name, res in rows:
        vals = [_metric_value(res.get(t, {}), m) for t, _, m in columns]
        have = [v for v in vals if v is not None]
        avg = sum(have) / len(have) if have else None
        avg_s = _fmt(avg) + (f" ({len(have)}/{len(vals)})" if have and len(have) < len(vals) else "")
        lines.append("| " + " | ".join([name] + [_fmt(v) for v in vals] + [avg_s]) + " |")
    return "\n".join(lines)


def headline(res: dict[str, dict[str, float]], columns: list[tuple[str, str, str]]) -> dict[str, float | None]:
    """``{task: headline metric}`` plus ``avg`` over the tasks that have a value."""
    vals = {t: _metric_value(res.get(t, {}), m) for t, _, m in columns}
    have = [v for v in vals.values() if v is not None]
    vals["avg"] = sum(have) / len(have) if have else None
    return vals
