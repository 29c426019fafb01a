"""A run's routing over time, in windows of steps (why does a run fall behind?).

For every finished run with routing statistics, the training is cut into ``windows`` equal
spans of steps; per span, from ``metrics.jsonl``:

* ``lr`` (mean), ``lambda`` (geometric mean over the span; per-layer control: over layers too)
  and ``reg_share``: the penalty (λ·L_reg, plus the auxiliary load-balancing loss of routers
  that have one, e.g. TopK's) as a share of the whole objective, the pull it exerts against
  the language-modelling loss;
* ``sparsity`` per layer (mean) and its largest distance from the target;
* ``dead`` per layer: the mean of ``dead_experts`` (experts of the layer with no token in a
  step);
* ``inactive``: experts (all layers) under a quarter of their fair share k/E of the tokens
  (:func:`remoe.lab.analysis.common.inactive_threshold`) on the calibration-set masks
  recorded last in the span (``routing/masks_*.npz``), when masks were recorded.

Dense and fixed-k runs get the rows too (no lambda, sparsity constant), so that dead and
inactive experts of TopK stand beside ReLU's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from remoe.lab.analysis.report_html import md_table, num


def windows(run_dir, n: int = 6) -> list[dict[str, Any]]:
    """Per window of steps: the figures of the module docstring ([] without metrics)."""
    from remoe.lab.analysis.common import inactive_threshold
    from remoe.lab.analysis.runlog import as_run, load_masks

    run = as_run(run_dir)  # a Run or its directory
    m = run.metrics
    if not len(m):
        return []
    target = run.target_sparsity
    steps = m.steps
    edges = np.linspace(0, int(steps.max()), n + 1)
    masks = run.mask_files()
    layer_S = m.layer_sparsity()
    dead_S = m.per_layer("dead_experts")
    lam_layers = m.per_layer("lambda_layers")
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (steps > lo) & (steps <= hi)
        if not sel.any():
            continue
        row: dict[str, Any] = {"steps": f"{int(lo) + 1}-{int(hi)}"}
        row["lr"] = float(np.nanmean(m["lr"][sel])) if m.has("lr") else None
        lam = lam_layers[sel] if lam_layers.shape[1] else m["lambda"][sel]
        lam = np.asarray(lam, float)
        pos = lam[np.isfinite(lam) & (lam > 0)]
        row["lambda"] = float(np.exp(np.mean(np.log(pos)))) if pos.size else None
        if m.has("reg_loss") and m.has("lm_loss") and m.has("loss"):
            term = m["loss"][sel] - m["lm_loss"][sel]  # lambda * L_reg (+ any aux loss)
            row["reg_share"] = float(np.nanmean(term / m["loss"][sel]))
        else:
            row["reg_share"] = None
        if layer_S.shape[1]:
            mean_L = np.nanmean(layer_S[sel], axis=0)
            row["sparsity"] = [float(v) for v in mean_L]
            row["dev_max"] = (float(np.nanmax(np.abs(mean_L - target)))
                              if target is not None else None)
        if dead_S.shape[1]:
            row["dead"] = [float(v) for v in np.nanmean(dead_S[sel], axis=0)]
        inside = [(s, p) for s, p in masks if lo < s <= hi or (lo == 0 and s == 0)]
        if inside and target is not None and target < 1.0:
            try:
                masks_LTN, _, _ = load_masks(inside[-1][1])
                row["inactive"] = int((masks_LTN.mean(axis=1)
                                       < inactive_threshold(1.0 - target)).sum())
                row["inactive_at"] = int(inside[-1][0])
            except (OSError, ValueError, KeyError):
                pass
        out.append(row)
    return out


def markdown_section(rows: list[dict[str, Any]], source) -> list[str]:
    """One table per finished routed run: its windows (``source(row)``: its Run or directory)."""
    lines: list[str] = []
    for row in rows:
        if row.get("state") != "done" or row.get("target_sparsity") is None:
            continue
        ws = windows(source(row))
        if not ws:
            continue
        if not lines:
            lines = ["## Over time", "",
                     "Per run, the training in six spans of steps: learning rate, lambda "
                     "(geometric mean), the penalty (λ·L_reg + auxiliary loss) as a share of "
                     "the objective, per-layer "
                     "sparsity (mean; target " f"{row['target_sparsity']:.3f}" "), dead experts "
                     "per layer (no token in a step; mean), inactive experts of all layers "
                     "(< 1/4 of the fair share k/E of the calibration tokens, on the span's last "
                     "masks). "
                     "Definitions: remoe.lab.study.overtime.", ""]
        head = ["steps", "lr", "lambda", "penalty share", "layer sparsity", "dead / layer",
                "inactive"]
        body = [[w["steps"], num(w.get("lr"), ".2e"), num(w.get("lambda"), ".2e"),
                 num(w.get("reg_share"), ".3f"),
                 "/".join(f"{v:.3f}" for v in w.get("sparsity", [])) or "–",
                 "/".join(f"{v:.2f}" for v in w.get("dead", [])) or "–",
                 (f"{w['inactive']} (step {w['inactive_at']})" if "inactive" in w else "–")]
                for w in ws]
        lines += [f"`{row['name']}`:", "", *md_table(head, body), ""]
    return lines
