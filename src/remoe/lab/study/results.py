"""Study results: one row per run (``results.csv``) and mean ± std over seeds (``results.md``).

Per run, from its directory (``summary.json``, ``eval.jsonl``, ``metrics.jsonl``,
``routing/masks_*.npz``):

* ``val_loss`` and ``val_<domain>``: the final validation (the last ``eval.jsonl`` record, else
  ``summary.json``); ``steps``, ``tokens``, ``flops`` (training FLOPs), ``train_s`` (the
  trainer's step time) and ``wall_s`` (the child process over every attempt, from study.json).
* For runs whose sparsity varies (an adaptive lambda, ReLU, or the thresholds of
  ``relu_threshold`` / ``expert_threshold``; not a router that fixes k, whose logged sparsity
  never changes: ``Stages.fixed``), flagged ``settles``: ``settle_step`` (:func:`detect_stages`
  with the trainer's defaults, as in its summary), ``flops_to_settle`` (training FLOPs of the steps
  before it), ``layer_sparsity`` (per layer, mean over the steps from settling on) and
  ``layer_dev_max`` (max over layers of |mean - (1 - k/E)|), ``lambda_log10_amp`` (log10 of
  max/min lambda over the steps from settling on; with per-layer ``lambda_layers`` in the
  metrics, the max over layers); over the second half of the run (steps after half the last
  step, past the settling transient whatever its length): ``lambda_log10_amp_late`` (the same
  span) and ``dead_per_layer_late`` (the mean of ``dead_experts``, the experts of a layer that
  got no token in the step, over those steps and the layers).
* ``inactive_experts``: experts (over all layers) that received fewer than a quarter of their
  fair share k/E of the tokens (the ``remoe analyze`` default,
  :func:`remoe.lab.analysis.common.inactive_threshold`; ``1/(4E)`` for k = 1), counted on
  the run's last recorded calibration-set routing masks (``inactive_source = masks@<step>``);
  without masks, from ``expert_counts`` in metrics.jsonl summed over the last 10% of steps
  (``inactive_source = expert_counts``). ``num_experts_total`` = layers x E*G.
  ``inactive_floor``: the fewest inactive experts the same routed shares allow whatever the
  balance (:func:`inactive_floor`): a layer whose tokens use ``a`` experts on average has room
  for at most ``floor(a / t)`` experts at the threshold share ``t`` of the tokens each.
* ``use_*``: expert use per layer (:mod:`remoe.lab.study.expertuse`, the "Expert use" table).

* ``zs:<task column>`` and ``zs:avg``: zero-shot accuracy (%) from ``RUN/eval_results.json``
  (``remoe eval RUN --tasks ...``, which a spec's ``eval:`` section runs on every trained run),
  each task with the metric ``remoe eval`` reports for it.

Aggregation: rows with the same (group, label) over seeds; mean ± sample standard deviation
(n - 1 in the denominator) with n, the number of finished seeds, shown.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

from remoe.fileio import atomic_write_text
from remoe.lab.analysis.report_html import is_number, md_table
from remoe.lab.analysis.runlog import run_has, run_json
from remoe.lab.study.spec import StudySpec

#: columns aggregated in results.md (key, header, format)
NUMERIC = [("val_loss", "val loss", ".4f"), ("flops", "train FLOPs", ".3g"),
           ("tokens", "tokens", ".3g"), ("wall_s", "wall s", ".0f")]
RELU_NUMERIC = [("settle_step", "settle step", ".0f"), ("flops_to_settle", "FLOPs to settle", ".3g"),
                ("layer_dev_max", "max layer dev. from target", ".3f"),
                ("inactive_experts", "inactive experts (< 1/4 fair share)", ".1f"),
                ("inactive_floor", "fewest inactive the layer densities allow", ".1f"),
                ("lambda_log10_amp", "lambda log10 amp. (III)", ".2f"),
                ("lambda_log10_amp_late", "lambda log10 amp. (2nd half)", ".2f"),
                ("dead_per_layer_late", "dead experts / layer / step (2nd half)", ".2f")]


def routed_ratio(run, target_sparsity: float | None) -> tuple[np.ndarray | None, str | None]:
    """(share of the tokens routed to each expert [L, N], source) per the module docstring;
    (None, None) for dense runs or without routing records."""
    if target_sparsity is None:
        return None, None
    last = run.last_masks()
    if last is not None:
        return last[1].mean(axis=1), f"masks@{last[0]}"
    recs = [r for r in run.metrics.records if isinstance(r.get("expert_counts"), list)]
    if not recs:
        return None, None
    tail = recs[len(recs) - max(1, math.ceil(0.1 * len(recs))):]
    counts_LN = np.sum([np.asarray(r["expert_counts"], dtype=np.float64) for r in tail], axis=0)
    tokens = float(sum(r.get("step_tokens", 0) for r in tail))
    if counts_LN.ndim != 2 or tokens <= 0:
        return None, None
    return counts_LN / tokens, "expert_counts"


def inactive_floor(ratio_LN: np.ndarray, threshold: float) -> int:
    """The fewest inactive experts the layers' densities allow: a layer whose token gets
    ``a = sum_e ratio_e`` experts on average can give at most ``floor(a / threshold)`` experts a
    share of ``threshold`` or more each, so at least ``N - floor(a / threshold)`` are inactive
    however evenly its load is spread."""
    t = threshold
    n = ratio_LN.shape[1]
    # a tiny tolerance: a layer at exactly a = m * t must not lose one to rounding
    fit_L = np.floor(ratio_LN.sum(axis=1) / t + 1e-9)
    return int(np.clip(n - fit_L, 0, n).sum())


def lambda_amplitude(records: list[dict[str, Any]], settle_step: int) -> float | None:
    """log10(max / min) of lambda over the records from ``settle_step`` on (per-layer lambdas:
    the largest layer amplitude)."""
    from remoe.method.stages import log10_span

    after = [r for r in records if int(r.get("step", -1)) >= settle_step]
    series: list[list[float]] = []
    layered = [r["lambda_layers"] for r in after if isinstance(r.get("lambda_layers"), list)]
    if layered and len({len(x) for x in layered}) == 1:
        series = [list(col) for col in zip(*layered)]
    else:
        series = [[r.get("lambda") for r in after]]
    amps = [log10_span(x) for x in (np.asarray([v for v in s if is_number(v) and v > 0], float)
                                    for s in series) if x.size >= 2]
    return max(amps) if amps else None


def run_row(run_dir) -> dict[str, Any]:
    """The numbers of one finished run (a Run or its directory; see the module docstring)."""
    from remoe.lab.analysis.common import inactive_threshold
    from remoe.lab.analysis.runlog import as_run
    from remoe.method.stages import detect_stages

    run = as_run(run_dir)
    run_dir = run.path
    s = run.summary
    row: dict[str, Any] = {k: s.get(k) for k in ("steps", "tokens", "flops", "router")}
    row["train_s"] = s.get("elapsed_s")
    last_eval = run.evals[-1] if run.evals else None
    row["val_loss"] = last_eval.get("val_loss") if last_eval else s.get("val_loss")
    domains = (last_eval or {}).get("domains") or s.get("val_domains") or {}
    for d, v in domains.items():
        row[f"val_{d}"] = v
    mc = run.model_config
    target = run.target_sparsity
    row["target_sparsity"] = target
    ratio_LN, source = routed_ratio(run, target)
    if ratio_LN is not None:
        threshold = inactive_threshold(1.0 - target)
        row.update(inactive_experts=int((ratio_LN < threshold).sum()),
                   num_experts_total=int(ratio_LN.size), inactive_source=source,
                   inactive_floor=inactive_floor(ratio_LN, threshold))
    else:
        row.update(inactive_experts=None, num_experts_total=None, inactive_source=None)
    m = run.metrics
    st = None
    if mc is not None and len(m) and m.has("sparsity") and target is not None:
        st = detect_stages(m.steps, m["sparsity"], target, m["lambda"] * m["reg_loss"],
                           m["lm_loss"])
    if st is not None and not st.fixed:  # held at the target by lambda or by thresholds
        row["settles"] = True
        row["settle_step"] = st.settle_step
        if st.settle_step is not None:
            before = m.steps < st.settle_step
            flops = m["flops"][before]
            row["flops_to_settle"] = float(flops[-1]) if flops.size else 0.0
            layer = m.layer_sparsity()
            after = m.steps >= st.settle_step
            if layer.shape[1] and after.any():
                mean_L = np.nanmean(layer[after], axis=0)
                row["layer_sparsity"] = "/".join(f"{v:.4f}" for v in mean_L)
                row["layer_dev_max"] = float(np.nanmax(np.abs(mean_L - target)))
            row["lambda_log10_amp"] = lambda_amplitude(m.records, st.settle_step)
        half = int(m.steps.max()) // 2
        row["lambda_log10_amp_late"] = lambda_amplitude(m.records, half + 1)
        dead = m.per_layer("dead_experts")[m.steps > half]
        if dead.size and np.isfinite(dead).any():
            row["dead_per_layer_late"] = float(np.nanmean(dead))
    row.update(zero_shot_row(run_dir))
    row["val_loss_full"] = full_split_loss(run_dir)
    return row


def full_split_loss(run_dir: Path) -> float | None:
    """The loss over the whole validation split (``remoe eval``, a spec's ``eval.loss``) from
    RUN/eval_results.json, else None."""
    try:
        v = run_json(run_dir, "eval_results.json")["models"][0]["loss"]["loss"]
    except (KeyError, IndexError, TypeError):
        return None
    return float(v) if is_number(v) else None


def zero_shot_row(run_dir: Path) -> dict[str, float]:
    """``{"zs:<column header>": accuracy %, ..., "zs:avg": mean}`` of RUN/eval_results.json."""
    try:
        doc = run_json(run_dir, "eval_results.json")
        model = doc["models"][0]
        columns = doc["tasks"]["columns"]
    except (KeyError, IndexError, TypeError):
        return {}
    out = {}
    for task, header, metric in columns:
        v = (model.get("zero_shot") or {}).get(task, {}).get(metric)
        if is_number(v):
            out[f"zs:{header}"] = 100.0 * float(v)
    if out:
        out["zs:avg"] = float(np.mean(list(out.values())))
    return out


def run_source(spec: StudySpec, runs_dir: Path, name: str) -> Path:
    """A run's directory when it finished there, else its committed copy (spec ``results:``,
    :mod:`remoe.lab.study.archive`) when there is one, else its directory."""
    from remoe.lab.study.archive import committed_dir

    d = runs_dir / name
    if run_has(d, "summary.json"):
        return d
    return committed_dir(spec.results_dir, name) or d


def collect(spec: StudySpec, runs_dir: Path, state: dict[str, Any] | None = None,
            opened: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per run of the spec: its identity, its state, and its numbers when finished
    (read from its directory, else from its committed copy); ``opened`` collects each finished
    row's :class:`~remoe.lab.analysis.runlog.Run` by its ``source``."""
    from remoe.lab.analysis.runlog import Run
    from remoe.lab.study.archive import run_state
    from remoe.lab.study.expertuse import expert_use_row

    runs_state = (state or {}).get("runs") or {}
    rows = []
    for r in spec.runs:
        d = run_source(spec, runs_dir, r.name)
        st = runs_state.get(r.name) or {}
        row: dict[str, Any] = {"name": r.name, "group": r.group, "label": r.label,
                               "seed": r.seed, "overrides": r.describe_overrides(),
                               "stop": r.describe_stop()}
        if run_has(d, "summary.json"):  # trained (zero-shot columns may still be pending)
            row["state"] = "done"
            row["source"] = str(d)
            run = Run(d)
            if opened is not None:
                opened[row["source"]] = run
            row.update(run_row(run))
            row["wall_s"] = st.get("total_wall_s") or run_state(d).get("total_wall_s") or None
            row.update(expert_use_row(run))
        else:
            row["state"] = st.get("state") if st.get("state") not in (None, "done") else "pending"
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    # the expert-use columns last, whatever row brought them (the others keep their places)
    keys = [k for k in keys if not k.startswith("use_")] + [k for k in keys if k.startswith("use_")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in keys})
    atomic_write_text(path, buf.getvalue())
    return path


def mean_std(values: list[Any]) -> tuple[float | None, float | None, int]:
    """Mean and sample std (n - 1) of the finite values; std None when n < 2."""
    x = np.asarray([v for v in values if is_number(v)], dtype=np.float64)
    if x.size == 0:
        return None, None, 0
    return float(x.mean()), (float(x.std(ddof=1)) if x.size >= 2 else None), int(x.size)


def fmt_mean_std(values: list[Any], spec: str) -> str:
    m, s, n = mean_std(values)
    if m is None:
        return "–"
    return f"{m:{spec}}" + (f" ± {s:{spec}}" if s is not None else "")


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (group, label): its finished rows and their seeds."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["group"], row["label"])
        e = out.setdefault(key, {"group": row["group"], "label": row["label"],
                                 "overrides": row["overrides"], "stop": row["stop"],
                                 "rows": [], "seeds": 0})
        e["seeds"] += 1
        if row.get("state") == "done":
            e["rows"].append(row)
    return list(out.values())


def _settles(row: dict[str, Any]) -> bool:
    """The run's sparsity varies and is held at the target (``settles``, set by :func:`run_row`)."""
    return row.get("settles") is True


def markdown(spec: StudySpec, rows: list[dict[str, Any]], out: Path) -> str:
    where = f"runs in `{out / 'runs'}`" + (
        f", finished runs' small outputs committed in `{_rel(spec.results_dir)}/runs`"
        if spec.results_dir else "")
    lines = [f"# Study `{spec.name}`", "",
             f"Spec `{_rel(spec.path)}`; {where}. Budget: {spec.budget}", "",
             "Mean ± sample std over seeds (n = finished seeds / seeds). Validation loss: the "
             "final evaluation; FLOPs: training FLOPs counted from the active experts; wall: "
             "the training process over every attempt. Definitions: docs/STUDY.md.", ""]
    done = sum(r.get("state") == "done" for r in rows)
    lines += [f"{done} of {len(rows)} runs finished.", ""]
    entries = aggregate(rows)
    for group in dict.fromkeys(e["group"] for e in entries):
        ges = [e for e in entries if e["group"] == group]
        domains = sorted({k for e in ges for r in e["rows"] for k in r
                          if k.startswith("val_") and k != "val_loss"})
        zero_shot = list(dict.fromkeys(k for e in ges for r in e["rows"] for k in r
                                       if k.startswith("zs:")))
        relu = any(r.get("target_sparsity") is not None and _settles(r)
                   for e in ges for r in e["rows"])
        lines += [f"## {group}", ""]
        numeric = NUMERIC
        if any(r.get("val_loss_full") is not None for e in ges for r in e["rows"]):
            numeric = NUMERIC[:1] + [("val_loss_full", "val loss, whole split", ".4f")] + NUMERIC[1:]
        head = ["run", "n"] + [h for _, h, _ in numeric] + [d[4:] for d in domains]
        body = []
        for e in ges:
            rs = e["rows"]
            body.append([f"`{e['label']}`", f"{len(rs)}/{e['seeds']}"]
                        + [fmt_mean_std([r.get(k) for r in rs], f) for k, _, f in numeric]
                        + [fmt_mean_std([r.get(d) for r in rs], ".3f") for d in domains])
        lines += md_table(head, body) + [""]
        if zero_shot:
            lines += ["Zero-shot accuracy (%, `remoe eval --tasks`; * = built from the held-out "
                      "split):", ""]
            lines += md_table(["run", "n"] + [k[3:] for k in zero_shot],
                              [[f"`{e['label']}`", f"{len(e['rows'])}/{e['seeds']}"]
                               + [fmt_mean_std([r.get(k) for r in e["rows"]], ".1f")
                                  for k in zero_shot] for e in ges]) + [""]
        if relu:
            head = ["run", "n"] + [h for _, h, _ in RELU_NUMERIC] + ["layer sparsity (mean of seeds)",
                                                                     "inactive from"]
            body = []
            for e in ges:
                rs = [r for r in e["rows"] if _settles(r)]
                if not rs:
                    continue
                per_layer = [[float(x) for x in r["layer_sparsity"].split("/")]
                             for r in rs if r.get("layer_sparsity")]
                layers = ("/".join(f"{v:.3f}" for v in np.mean(per_layer, axis=0))
                          if per_layer and len({len(p) for p in per_layer}) == 1 else "–")
                total = rs[0].get("num_experts_total")
                body.append([f"`{e['label']}`", f"{len(rs)}/{e['seeds']}"]
                            + [fmt_mean_std([r.get(k) for r in rs], f) for k, _, f in RELU_NUMERIC]
                            + [layers, f"{rs[0].get('inactive_source') or '–'}"
                               + (f" (of {total})" if total else "")])
            lines += ["Sparsity control (runs whose sparsity varies: ReLU, threshold routers; "
                      "after settling):", ""]
            lines += md_table(head, body) + [""]
        lines += ["<details><summary>runs of this group</summary>", ""]
        lines += md_table(["run", "overrides", "stop"],
                          [[f"`{e['label']}`", e["overrides"] or "–", e["stop"]] for e in ges])
        lines += ["", "</details>", ""]
    pending = [r for r in rows if r.get("state") != "done"]
    if pending:
        lines += ["Not finished: " + ", ".join(f"`{r['name']}` ({r.get('state')})"
                                               for r in pending), ""]
    return "\n".join(lines)


def write_results(spec: StudySpec, out: Path, state: dict[str, Any] | None) -> tuple[Path, Path, list]:
    """``results.csv``, ``results.md`` and, where runs have periodic evaluations,
    ``curves.csv`` / ``curves.png`` (:mod:`remoe.lab.study.curves`) into ``out`` and, for a spec
    with ``results:``, the same files into that directory beside the committed runs."""
    from remoe.lab.study import curves, expertuse

    opened: dict[str, Any] = {}  # each finished run read once, for every section
    rows = collect(spec, (out / "runs").resolve(), state, opened)

    def run_of(row):
        return opened[row["source"]]

    run_curves, label_curves = curves.collect_curves(rows, run_of)
    text = markdown(spec, rows, out)
    if label_curves:
        text += "\n" + "\n".join(curves.markdown_section(label_curves)) + "\n"
        from remoe.lab.study import overtime

        over = overtime.markdown_section(rows, run_of)
        if over:
            text += "\n" + "\n".join(over) + "\n"
    if any(r.init_of for r in spec.runs):
        from remoe.lab.study import continued

        cont = continued.markdown_section(spec, rows, run_of)
        if cont:
            text += "\n" + "\n".join(cont) + "\n"
    use = expertuse.markdown_section(aggregate(rows), fmt_mean_std)
    if use:
        text += "\n" + "\n".join(use) + "\n"
    csv_path = md = None
    for d in dict.fromkeys([Path(out)] + ([spec.results_dir] if spec.results_dir else [])):
        d.mkdir(parents=True, exist_ok=True)
        public = [{k: v for k, v in row.items() if k != "source"} for row in rows]
        p_csv = write_csv(d / "results.csv", public)
        p_md = d / "results.md"
        atomic_write_text(p_md, text)
        if run_curves:
            curves.write_csv(d / "curves.csv", run_curves)
            curves.write_figure(d / "curves.png", label_curves)
        csv_path, md = csv_path or p_csv, md or p_md
    return csv_path, md, rows


def _rel(path: Path) -> str:
    """A path relative to the working directory where it lies below it (stable in committed
    tables), else as it is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
