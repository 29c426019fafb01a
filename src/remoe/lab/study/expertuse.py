"""The "Expert use" table of a study: per run (mean ± std over seeds) and MoE layer, how many
of its experts a run uses (:mod:`remoe.lab.analysis.expertuse`, docs/STUDY.md).

Per finished run, :func:`expert_use_row` adds ``use_*`` columns to ``results.csv``: per-layer
values joined by ``/`` (like ``layer_sparsity``); :func:`markdown_section` averages them over
the seeds of each (group, label), every routed run (TopK beside ReMoE) in spec order.
"""

from __future__ import annotations

from typing import Any, Callable

from remoe.lab.analysis.report_html import md_table

#: (results.csv column, source key in remoe.lab.analysis.expertuse, table header, format)
COLUMNS = [("use_experts_per_token", "experts_per_token", "experts / token", ".2f"),
           ("use_effective_experts", "effective_experts", "effective experts", ".1f"),
           ("use_never_firing", "never_firing", "never-firing", ".1f"),
           ("use_no_expert_share", "no_expert_share", "no expert (% of tokens)", ".1f"),
           ("use_inactive", "inactive", "inactive", ".1f")]
PERCENT = {"use_no_expert_share"}


def expert_use_row(run_dir) -> dict[str, Any]:
    """The ``use_*`` columns of one finished run ({} for a run without routed experts)."""
    from remoe.lab.analysis.expertuse import layer_rows, run_expert_use
    from remoe.lab.analysis.runlog import as_run

    use = run_expert_use(as_run(run_dir))  # a Run or its directory
    if use is None:
        return {}
    rows = layer_rows(use)
    out: dict[str, Any] = {}
    for col, key, _, _ in COLUMNS:
        vals = [r[key] for r in rows]
        if all(v is not None for v in vals) and vals:
            out[col] = "/".join(f"{float(v):.6g}" for v in vals)
    train, calib = use.get("train"), use.get("calib")
    if train:
        out["use_steps"] = f"{train['steps'][0]}-{train['steps'][1]}"
    if calib:
        out["use_masks"] = f"masks@{calib['step']} (of {calib['num_experts']})"
    return out


def _per_layer(text: Any) -> list[float] | None:
    if not isinstance(text, str) or not text:
        return None
    return [float(x) for x in text.split("/")]


def markdown_section(entries: list[dict[str, Any]],
                     fmt_mean_std: Callable[[list[Any], str], str]) -> list[str]:
    """The table over ``entries`` (:func:`remoe.lab.study.results.aggregate`), cells by
    ``fmt_mean_std(values, format)`` (the study tables' mean ± std); [] when no run has
    expert-use columns."""
    labels = [e["label"] for e in entries]
    body = []
    for e in entries:
        rs = [r for r in e["rows"] if any(r.get(c) for c, _, _, _ in COLUMNS)]
        if not rs:
            continue
        name = e["label"] if labels.count(e["label"]) == 1 else f"{e['group']} / {e['label']}"
        per_run = [{c: _per_layer(r.get(c)) for c, _, _, _ in COLUMNS} for r in rs]
        L = max((len(v) for p in per_run for v in p.values() if v), default=0)
        for l in range(L):
            cells = []
            for c, _, _, f in COLUMNS:
                scale = 100.0 if c in PERCENT else 1.0
                cells.append(fmt_mean_std([p[c][l] * scale for p in per_run
                                           if p[c] and len(p[c]) == L], f))
            body.append([f"`{name}`" if l == 0 else "", f"{len(rs)}/{e['seeds']}" if l == 0
                         else "", str(l)] + cells
                        + [(rs[0].get("use_masks") or "–") if l == 0 else ""])
    if not body:
        return []
    head = ["run", "n", "layer"] + [h for _, _, h, _ in COLUMNS] + ["masks"]
    return (["## Expert use", "",
             "Per MoE layer, mean ± std over seeds. Experts per token, effective experts (exp of "
             "the entropy of the layer's load) and never-firing experts (no token in the step): "
             "each training step's, averaged over the last 10% of the steps (metrics "
             "`expert_counts`). No-expert share (tokens routed to no expert) and inactive "
             "experts (fewer than a quarter of the fair share k/E of the tokens) on the last "
             "recorded calibration masks. Definitions: docs/STUDY.md.", ""]
            + md_table(head, body) + [""])
