"""Fit lm-eval tasks to a model's context, before lm-eval sees them (one place, every task).

lm-eval asserts instead of explaining when a request cannot fit: a continuation longer than the
model's context (``assert len(continuation_enc) <= self.max_length``) or a generation budget
that leaves no room for a prompt (``max_gen_toks >= max_length``). :func:`fit_tasks` looks at
every request a task will make, tokenised exactly as lm-eval's ``HFLM`` does, and

* keeps examples whose context is too long: lm-eval cuts the context from the left (never the
  continuation), which ``run_tasks`` counts as ``truncated``;
* skips an example (all of its requests) when a continuation alone does not fit, counted per
  task and reported in one warning line;
* lowers a generation task's ``max_gen_toks`` to half the context when it would leave none.

A task left with no example is dropped from the run (reported as skipped).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("remoe.eval")


@dataclass
class FitReport:
    """What fitting changed: examples skipped per task, tasks dropped, generation budgets."""

    skipped: dict[str, int] = field(default_factory=dict)  # task -> examples skipped
    dropped: list[str] = field(default_factory=list)  # tasks with no example left
    max_gen_toks: dict[str, tuple[int, int]] = field(default_factory=dict)  # task -> (old, new)


def _leaf_tasks(objs: list[Any]) -> list[Any]:
    from lm_eval.api.group import Group

    out = []
    for o in objs:
        out.extend(o.get_all_tasks() if isinstance(o, Group) else [o])
    return out


def _continuation_len(lm: Any, context: str, continuation: str) -> int:
    """Tokens of ``continuation`` as lm-eval's ``TemplateLM.loglikelihood`` encodes it."""
    if context == "":
        return len(lm.tok_encode(continuation))
    return len(lm._encode_pair(context, continuation)[1])


def _too_long_docs(lm: Any, task: Any, max_len: int) -> set[int]:
    if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(rank=0, world_size=1)
    bad = set()
    for inst in task.instances:
        if inst.request_type == "loglikelihood" and inst.doc_id not in bad:
            context, continuation = inst.arguments[:2]
            if _continuation_len(lm, context, continuation) > max_len:
                bad.add(inst.doc_id)
    task._instances = None  # lm-eval builds them again, from the fitted documents
    return bad


def _keep_docs(task: Any, bad: set[int]) -> int:
    """Replace the task's evaluation documents by those not in ``bad``; returns how many are
    left."""
    docs = task.eval_docs
    keep = [i for i in range(len(docs)) if i not in bad]
    kept = docs.select(keep) if hasattr(docs, "select") else [docs[i] for i in keep]
    attr = "test_docs" if task.has_test_docs() else "validation_docs"
    setattr(task, attr, lambda: kept)  # this task object only
    return len(keep)


def fit_tasks(lm: Any, objs: list[Any]) -> tuple[list[Any], FitReport]:
    """Fit built lm-eval tasks/groups ``objs`` to ``lm.max_length``; returns the objects to run
    and what changed (logged as one warning per kind of change)."""
    report = FitReport()
    max_len = getattr(lm, "max_length", None)
    if not isinstance(max_len, int) or not hasattr(lm, "tok_encode"):
        return objs, report  # not a token-level LM (e.g. a scripted test LM): nothing to fit
    empty: set[str] = set()
    for task in _leaf_tasks(objs):
        name = task.task_name if hasattr(task, "task_name") else task.config.task
        kind = task.get_config("output_type")
        if kind == "generate_until":
            gen = dict(task.get_config("generation_kwargs") or {})
            old = int(gen.get("max_gen_toks", getattr(lm, "max_gen_toks", 256)))
            if old >= max_len:
                new = max(max_len // 2, 1)
                task.set_config(key="generation_kwargs", value={"max_gen_toks": new},
                                update=True)
                report.max_gen_toks[name] = (old, new)
        elif kind in ("loglikelihood", "multiple_choice"):
            bad = _too_long_docs(lm, task, max_len)
            if bad:
                report.skipped[name] = len(bad)
                if _keep_docs(task, bad) == 0:
                    empty.add(name)
    if report.skipped:
        log.warning("skipped %s: a continuation alone is longer than the model's context (%d "
                    "tokens)", ", ".join(f"{n} example(s) of {t}" for t, n in
                                         sorted(report.skipped.items())), max_len)
    for t, (old, new) in sorted(report.max_gen_toks.items()):
        log.warning("%s: max_gen_toks %d leaves no room in the model's context (%d tokens); "
                    "generating at most %d tokens", t, old, max_len, new)
    if empty:
        report.dropped = sorted(empty)
        log.warning("not run (no example fits the model's context): %s", ", ".join(report.dropped))
        objs = [o for o in objs if getattr(o, "task_name", None) not in empty]
    return objs, report
