"""Runs that start from another study run's weights (``init_from_run``; the recipes of configs/study/recipes.yaml).

For every finished run with an ``init_from.json`` (:mod:`remoe.train.init_from`), one row:

* the source run, the first λ and the rule that chose it (``init_from.json``);
* ``first LM loss``: the training LM loss of the run's first step, right after the swap or
  upcycling, beside the source's last logged LM loss (trailing mean of 20 steps);
* the validation loss at the run's first evaluation and at its end;
* ``steps to target``: the first step from which the 5-step mean of the sparsity stays within
  0.02 of the target to the end (:func:`remoe.method.stages.detect_stages`; ``-`` for routers whose
  sparsity is fixed);
* the final sparsity and the inactive experts (below a quarter of the fair share k/E of the
  tokens) on the last recorded masks;
* ``FLOPs incl. source``: the run's training FLOPs plus those of its sources, recursively,
  the total compute the continued model cost -- what a from-scratch run is matched against.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from remoe.lab.analysis.report_html import md_table, num
from remoe.lab.study.spec import StudySpec


def total_flops(spec: StudySpec, name: str, flops_of: Callable[[str], float | None]
                ) -> float | None:
    """``name``'s training FLOPs plus those of the runs it started from (None: one missing)."""
    by = spec.by_name()
    total, cur = 0.0, by.get(name)
    while cur is not None:
        f = flops_of(cur.name)
        if f is None:
            return None
        total += f
        cur = by.get(cur.init_of) if cur.init_of else None
    return total


def continued_row(run_dir) -> dict[str, Any]:
    """The figures of the module docstring for one finished run directory (or its committed
    copy)."""
    from remoe.lab.analysis.common import inactive_threshold
    from remoe.lab.analysis.runlog import as_run, load_masks, run_json
    from remoe.method.stages import detect_stages

    run = as_run(run_dir)  # a Run or its directory
    rec = run_json(run.path, "init_from.json") or {}
    m = run.metrics
    row: dict[str, Any] = {"lambda_start": rec.get("lambda_start"),
                           "lambda_rule": rec.get("lambda_rule"),
                           "conversion": rec.get("conversion") or []}
    if len(m):
        row["first_lm_loss"] = float(m["lm_loss"][0])
        row["final_sparsity"] = float(m["sparsity"][-1]) if m.has("sparsity") else None
        target = run.target_sparsity
        if target is not None and m.has("sparsity"):
            st = detect_stages(m.steps, m["sparsity"], target)
            row["steps_to_target"] = st.reported_settle_step
    evals = [e for e in run.evals if e.get("val_loss") is not None]
    if evals:
        row["first_eval"] = (int(evals[0]["step"]), float(evals[0]["val_loss"]))
        row["val_loss"] = float(evals[-1]["val_loss"])
    masks = run.mask_files()
    target = run.target_sparsity
    if masks and target is not None and target < 1.0:
        masks_LTN = load_masks(masks[-1][1])[0]
        ratio_LN = masks_LTN.mean(axis=1)
        row["inactive"] = int((ratio_LN < inactive_threshold(1.0 - target)).sum())
        row["experts"] = int(ratio_LN.size)
    return row


def source_lm_loss(run_dir, last: int = 20) -> float | None:
    from remoe.lab.analysis.runlog import as_run

    m = as_run(run_dir).metrics  # a Run or its directory
    return float(np.mean(m["lm_loss"][-last:])) if len(m) else None


def markdown_section(spec: StudySpec, rows: list[dict[str, Any]],
                     source_of: Callable[[dict[str, Any]], Any]) -> list[str]:
    """The "Runs started from other runs" section ([] when the spec has none finished)."""
    by_row = {row["name"]: row for row in rows}
    done = {n: row for n, row in by_row.items() if row.get("state") == "done"}

    def flops_of(name: str) -> float | None:
        row = done.get(name)
        return float(row["flops"]) if row and row.get("flops") is not None else None

    body = []
    for r in spec.runs:
        if r.name not in done:
            continue
        src = done.get(r.init_of) if r.init_of else None
        c = continued_row(source_of(done[r.name]))
        if not r.init_of and not c.get("lambda_rule"):
            continue
        lam = c.get("lambda_start")
        lam_txt = ("–" if not lam else "/".join(f"{x:.3g}" for x in lam)
                   + (f" ({c['lambda_rule']})" if c.get("lambda_rule") else ""))
        lam_txt = lam_txt.replace("|", "\\|")  # the rule may hold |g| (a table cell)
        src_lm = source_lm_loss(source_of(src)) if src else None
        first = c.get("first_eval")
        inact = (f"{c['inactive']} of {c['experts']}" if c.get("experts") is not None else "–")
        tot = total_flops(spec, r.name, flops_of)
        body.append([f"`{r.name}`", f"`{r.init_of}`" if r.init_of else "–",
                     f"{num(src_lm, '.3f')} → {num(c.get('first_lm_loss'), '.3f')}",
                     f"{num(first[1], '.4f')} (step {first[0]})" if first else "–",
                     num(c.get("val_loss"), ".4f"), num(c.get("steps_to_target"), "d"),
                     num(c.get("final_sparsity"), ".3f"), inact, lam_txt, num(tot, ".3g")])
    if not body:
        return []
    head = ["run", "from", "LM loss: source's last 20 → first step", "val loss, first eval",
            "val loss, end", "steps to target (±0.02)", "final sparsity",
            "inactive experts (< 1/4 fair share)",
            "first λ (rule)", "FLOPs incl. source"]
    return ["## Runs started from other runs' weights", "",
            "Per run with `init_from_run` (definitions: remoe.lab.study.continued). FLOPs incl. "
            "source: the run's training FLOPs plus its sources', the compute a from-scratch "
            "run is matched against.", "", *md_table(head, body), ""]
