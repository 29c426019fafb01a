"""The facts of one run that ``remoe report`` shows: losses, final lambda, model size, zero-shot
accuracies (read from the run's logs, ``summary.json`` and ``eval_results.json``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from remoe.lab.analysis.runlog import Run


def last_lm_loss(run: Run, n: int = 20) -> float | None:
    """Mean training LM loss of the last ``n`` logged steps."""
    lm = run.metrics["lm_loss"] if len(run.metrics) else np.zeros(0)
    lm = lm[np.isfinite(lm)]
    return float(lm[-n:].mean()) if lm.size else None


def final_eval(run: Run) -> dict[str, Any] | None:
    return run.evals[-1] if run.evals else None


def val_label(run: Run) -> str:
    """What the training log's validation loss is computed on (``train.eval_chunks_per_domain``
    sequences per domain), as opposed to ``remoe eval``'s whole split."""
    n = (run.config.get("train") or {}).get("eval_chunks_per_domain")
    return (f"validation ({n} sequences per domain, during training)" if n
            else "validation (sequences capped per domain, during training)")


def eval_loss(run: Run) -> tuple[float, str] | None:
    """The held-out loss ``remoe eval`` wrote into the run's ``eval_results.json`` and a label
    naming its data (the whole split unless ``--loss-chunks`` capped it)."""
    res = run.eval_results
    models = res.get("models") if isinstance(res, dict) else None
    if not isinstance(models, list) or len(models) != 1 or not isinstance(models[0], dict):
        return None
    loss = models[0].get("loss")
    if not isinstance(loss, dict) or not is_number(loss.get("loss")):
        return None
    chunks = res.get("loss_chunks_per_domain")
    data = (f"at most {chunks} sequences per domain" if chunks else "the whole split")
    split = loss.get("split", res.get("split", "held-out"))
    return float(loss["loss"]), f"{split} ({data}, remoe eval)"


def final_lambda(run: Run) -> tuple[float | None, float | None]:
    """``(λ after the last update, λ used in the last step)``. The first is what the training
    summary prints (``summary.json``'s ``final_lambda``: the coefficient the next step would
    use); the second is the last ``lambda`` of ``metrics.jsonl``. They differ by one α step."""
    nxt = run.summary.get("final_lambda")
    return (float(nxt) if is_number(nxt) else None), last_value(run, "lambda")


def model_facts(run: Run) -> dict[str, Any]:
    cfg = run.model_config
    s = run.summary
    r = cfg.routing if cfg is not None else None
    facts = {"router": run.router, "E": getattr(r, "num_experts", None),
             "k": getattr(r, "top_k", None), "G": getattr(r, "granularity", None),
             "params_total": s.get("params_total"), "params_active": s.get("params_active")}
    if cfg is not None and not cfg.is_moe:
        facts.update(E=None, k=None, G=None)
    return facts


def zero_shot(run: Run) -> dict[str, dict[str, float]]:
    """``{model name: {task: accuracy in %}}`` from the run's ``eval_results.json``.

    Two layouts are read: the file ``remoe eval --out`` writes (``models`` a list of
    ``{"name", "zero_shot": {task: {metric: value}}}`` and ``tasks.columns`` naming each task's
    headline metric and column header), and the simple ``{"models": {name: {"tasks": {task:
    value}}}}``. A value is a number (a fraction <= 1 is shown in %) or a mapping of metrics
    (``acc``, else ``acc_norm``, lm-eval's ``acc,none`` spelling included, else the first
    number)."""
    res = run.eval_results
    if not isinstance(res, dict):
        return {}
    models = res.get("models")
    columns = ((res.get("tasks") or {}).get("columns") if isinstance(res.get("tasks"), dict)
               else None) or []
    if isinstance(models, list):
        entries = [(str(m.get("name", i)), m.get("zero_shot")) for i, m in enumerate(models)
                   if isinstance(m, dict)]
    elif isinstance(models, dict):
        entries = [(str(n), m.get("tasks") if isinstance(m, dict) else None)
                   for n, m in models.items()]
    else:
        return {}
    headers = {c[0]: (c[1], c[2]) for c in columns if isinstance(c, (list, tuple)) and len(c) == 3}
    out: dict[str, dict[str, float]] = {}
    for name, tasks in entries:
        if not isinstance(tasks, dict):
            continue
        row = {}
        for task, v in tasks.items():
            header, metric = headers.get(task, (task, None))
            v = _metric(v, metric)
            if v is not None:
                row[str(header)] = v * (100.0 if abs(v) <= 1.0 else 1.0)
        if row:
            out[name] = row
    return out


def _metric(v: Any, metric: str | None) -> float | None:
    if isinstance(v, dict):
        keys = ([metric] if metric else []) + ["acc", "acc_norm"]
        found = next((v[k] for m in keys for k in (m, f"{m},none") if is_number(v.get(k))), None)
        v = found if found is not None else next((x for x in v.values() if is_number(x)), None)
    return float(v) if is_number(v) else None


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(v: Any, spec: str) -> str:
    """``v`` formatted by ``spec`` where it :func:`is_number`, else "–" (the study's tables)."""
    return format(v, spec) if is_number(v) else "–"


def last_value(run: Run, key: str) -> float | None:
    """The last logged value of ``key`` in ``metrics.jsonl`` (None if none or not finite)."""
    if not len(run.metrics):
        return None
    v = run.metrics[key][-1]
    return float(v) if math.isfinite(v) else None


def adaptive_lambda(router: str | None) -> bool:
    """Whether ``router`` declares an adaptive lambda (remoe.model.registry); unknown names: no."""
    from remoe.model import registry

    try:
        return bool(router) and bool(registry.declares(router, "uses_adaptive_reg"))
    except Exception:  # a router registered by a module this process has not imported
        return False
