"""One self-contained HTML report of one or several runs (figures embedded as base64 PNG).

For every run :func:`remoe.lab.analysis.analyze.analyze` is run first (its files land in the run's
``analysis/`` directory, the routing statistics are cached there), then the page is assembled:
a comparison section (summary table, LM loss vs step and vs FLOPs, validation loss per domain,
flip rates, zero-shot accuracies from ``eval_results.json``) and one section per run (config,
losses, sparsity / lambda / stages, settling time, per-domain validation loss, routing figures,
specialisation number). The facts of a run it shows (losses, final lambda, model size,
zero-shot accuracies) are read from the run's logs, ``summary.json`` and ``eval_results.json``;
the HTML pieces are in :mod:`remoe.lab.analysis.report_html`.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from remoe.lab.analysis import plots
from remoe.lab.analysis.analyze import Options, analyze, unique_name
from remoe.lab.analysis.report_html import CSS, esc, fmt, img, is_number, table
from remoe.lab.analysis.runlog import Run


@dataclass
class ReportOptions:
    analysis: Options
    title: str = "remoe report"
    analysis_root: Path | None = None  # run X is analysed into analysis_root/X (default X/analysis)
    extra_html: tuple[str, ...] = ()  # sections placed after the comparison (e.g. a study's curves)


def build_report(run_paths: list[str], opts: ReportOptions, log=print) -> str:
    runs = [Run(p) for p in run_paths]
    names: list[str] = []
    for r in runs:
        names.append(unique_name(r.name, names))
    results, outs = [], []
    for r, n in zip(runs, names):
        out = (opts.analysis_root / _slug(n)) if opts.analysis_root else r.path / "analysis"
        log(f"analysing {r.path} -> {out}")
        results.append(analyze(r, out, replace(opts.analysis, compare=[]), log=log, reuse=True))
        outs.append(out)
    anchors = [f"run-{i}" for i in range(len(runs))]
    nav = "<nav>" + '<a href="#compare">comparison</a>' + "".join(
        f'<a href="#{a}">{esc(n)}</a>' for a, n in zip(anchors, names)) + "</nav>"
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [f"<h1>{esc(opts.title)}</h1>",
            f'<p class="note">Generated {when} by <code>remoe report</code> from '
            f"{len(runs)} run(s). Definitions: docs/ANALYSIS.md.</p>", nav,
            comparison_section(runs, names, results, outs), *opts.extra_html]
    body += [run_section(r, n, a, res, o)
             for r, n, a, res, o in zip(runs, names, anchors, results, outs)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(opts.title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ----------------------------------------------------------------------------- sections

def settling_cell(router: str | None, st: dict):
    """Settling time for the tables: n/a where the router fixes the sparsity by construction
    (its logged sparsity never changes: TopK, Hash, ...), as in the training summary; the
    settling time of every run whose sparsity is held by a controller (ReMoE's lambda, the
    threshold routers). A stages record without ``fixed`` (older): by the router's lambda."""
    if fixed_sparsity(router, st):
        return "n/a (sparsity fixed by the router)"
    return st.get("settling_time")


def fixed_sparsity(router: str | None, st: dict) -> bool:
    """Whether the run's sparsity is fixed by its router (``Stages.fixed``; a stages record
    without it, from an older analysis: whether the router has no adaptive lambda)."""
    return bool(st.get("fixed", not adaptive_lambda(router)))


def comparison_section(runs: list[Run], names: list[str], results: list[dict],
                       outs: list[Path]) -> str:
    parts = ['<h2 id="compare">Comparison</h2>']
    rows = []
    for run, name, res in zip(runs, names, results):
        f = model_facts(run)
        ev = final_eval(run)
        st, sp, fl, sc = (res.get(k) or {} for k in ("stages", "sparsity", "flips",
                                                      "specialization"))
        rows.append([esc(name), esc(f["router"]), f["E"], f["k"], f["G"], f["params_total"],
                     f["params_active"], int(run.metrics.steps[-1]) if len(run.metrics) else None,
                     last_value(run, "tokens"), last_value(run, "flops"), last_lm_loss(run),
                     ev.get("val_loss") if ev else None, (eval_loss(run) or (None,))[0],
                     settling_cell(f["router"], st), sp.get("mean"), fl.get("mean_flip_rate"),
                     sc.get("index")])
    parts.append(table(["run", "router", "E", "k", "G", "params", "active params", "steps",
                        "tokens", "FLOPs", "train LM loss (last 20)",
                        "val loss (training: capped sequences per domain)",
                        "held-out loss (remoe eval)", "settling time", "sparsity (mean)",
                        "flip rate (mean)", "specialisation index"], rows, left=2,
                       best={10: "min", 11: "min", 12: "min"}))
    parts.append('<p class="note">Two validation losses: the training log\'s is computed on '
                 '<code>train.eval_chunks_per_domain</code> sequences per domain (fast, every '
                 '<code>train.eval_every</code> steps); <code>remoe eval RUN</code> computes it '
                 'on the whole split (written to RUN/eval_results.json).</p>')

    curves = {n: (r.metrics.steps, r.metrics["lm_loss"]) for r, n in zip(runs, names)
              if len(r.metrics)}
    evals_step = {n: ([e["step"] for e in r.evals], [e.get("val_loss") for e in r.evals])
                  for r, n in zip(runs, names) if r.evals}
    if curves:
        parts.append(img(plots.png_bytes(plots.fig_curves(
            curves, "step", "LM loss", "training LM loss vs step", evals=evals_step)),
            "Training LM loss (faint: every step; bold: trailing mean); squares: validation loss."))
        flops = {n: (r.metrics["flops"], r.metrics["lm_loss"]) for r, n in zip(runs, names)
                 if r.metrics.has("flops")}
        if flops:
            evals_flops = {}
            for r, n in zip(runs, names):
                if r.evals and r.metrics.has("flops"):
                    fx = np.interp([e["step"] for e in r.evals], r.metrics.steps,
                                   r.metrics["flops"])
                    evals_flops[n] = (fx, [e.get("val_loss") for e in r.evals])
            parts.append(img(plots.png_bytes(plots.fig_curves(
                flops, "training FLOPs (active experts counted)", "LM loss",
                "training LM loss vs FLOPs", evals=evals_flops)),
                "Training LM loss against cumulative training FLOPs."))

    domains = sorted({d for r in runs for d in ((final_eval(r) or {}).get("domains") or {})})
    if domains:
        drows = []
        for r, n in zip(runs, names):
            ev = final_eval(r) or {}
            dl = ev.get("domains") or {}
            drows.append([esc(n), ev.get("step")] + [dl.get(d) for d in domains]
                         + [ev.get("val_loss")])
        parts.append("<h3>Validation loss per domain (last evaluation during training: "
                     "capped sequences per domain)</h3>")
        parts.append(table(["run", "step"] + domains + ["all"], drows, left=1,
                           best={i: "min" for i in range(2, len(domains) + 3)}))

    flips = {n: _flips_csv(o / "flips.csv", res["flips"]["num_experts"])
             for n, res, o in zip(names, results, outs)
             if res.get("flips") and (o / "flips.csv").is_file()}
    if len(flips) >= 2:  # one run: its own section shows its flips.png
        parts.append("<h3>Routing stability</h3>")
        parts.append(img(plots.png_bytes(plots.fig_flips(flips, "flip rate and flip count")),
                         "Flip rate between consecutive recorded masks of the fixed calibration "
                         "set (Appendix A); flip count = N × flip rate."))

    zs = {}
    for r, n in zip(runs, names):
        for model, row in zero_shot(r).items():
            if zs.get(model, row) != row:  # another run's file has a different result
                model = f"{model} (eval_results of {n})"
            zs[model] = row
    parts.append("<h3>Zero-shot accuracy</h3>")
    if zs:
        tasks = sorted({t for row in zs.values() for t in row})
        zrows = []
        for model, row in zs.items():
            have = [row[t] for t in tasks if t in row]
            zrows.append([esc(model)] + [row.get(t) for t in tasks]
                         + [sum(have) / len(have) if have else None])
        parts.append(table(["model"] + tasks + ["Avg."], zrows, left=1,
                           best={i: "max" for i in range(1, len(tasks) + 2)}, digits=2))
        parts.append('<p class="note">Accuracy in % (from each run\'s eval_results.json).</p>')
    else:
        parts.append('<p class="note">No zero-shot results in these runs\' '
                     'eval_results.json (write them with <code>remoe eval RUN</code>).</p>')
    return "\n".join(parts)


def _flips_csv(path: Path, num_experts: int) -> tuple[list[int], list[float], int]:
    """(steps, flip rates, N) from an analysis' ``flips.csv``."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [int(r["step"]) for r in rows], [float(r["flip_rate"]) for r in rows], num_experts


FIGURES = [  # (analysis, file, caption)
    ("stages", "stages.png", "Three-stage training (Fig. 4): sparsity, λ and L_reg, L_lm and "
                             "λ·L_reg; shading: stages I (dense), II (sparsifying), "
                             "III (stable)."),
    ("sparsity", "sparsity.png", "Sparsity at every step with mean ± std after warm-up (Fig. 3)."),
    ("sparsity", "layer_sparsity.png", "Sparsity of each layer (Fig. 7d)."),
    ("flips", "flips.png", "Flip rate and flip count (Appendix A)."),
    ("heatmap", "routed_ratio.png", "Average routed tokens ratio per layer and expert (Fig. 7b/c);"
                                    " hatched: inactive experts (the rule beside the inactive"
                                    " count)."),
    ("specialization", "specialization.png", "Routed tokens ratio per domain (Fig. 8)."),
    ("allocation", "allocation_domains.png", "Mean active experts per domain and layer (App. H)."),
    ("allocation", "allocation_tokens.png", "Mean active experts vs token frequency (Fig. 6)."),
]


def run_section(run: Run, name: str, anchor: str, res: dict, out: Path) -> str:
    parts = [f'<h2 id="{anchor}">Run: {esc(name)}</h2>',
             f'<p class="note">{esc(run.path.resolve())}</p>']
    f = model_facts(run)
    ev = final_eval(run)
    st = res.get("stages") or {}
    sp = res.get("sparsity") or {}
    facts = [("router", esc(f["router"])),
             ("E, k, G", ", ".join(fmt(f[x]) for x in ("E", "k", "G"))),
             ("parameters (total / active)",
              f"{fmt(f['params_total'])} / {fmt(f['params_active'])}"),
             ("steps / tokens", f"{fmt(int(run.metrics.steps[-1]) if len(run.metrics) else None)}"
                                f" / {fmt(last_value(run, 'tokens'))}"),
             ("final train LM loss (mean of last 20 steps)", fmt(last_lm_loss(run))),
             (f"final {val_label(run)} loss", fmt(ev.get("val_loss")) if ev else "–")]
    el = eval_loss(run)
    if el is not None:
        facts.append((f"held-out loss: {el[1]}", fmt(el[0])))
    nxt, used = final_lambda(run)
    if not adaptive_lambda(f["router"]):
        facts.append(("final λ", "– (no adaptive λ for this router)"))
    elif nxt is not None:
        facts.append(("final λ (after the last update: the next step's, as in the training "
                      "summary)", f"{fmt(nxt)} (used in the last step: {fmt(used)})"))
    else:
        facts.append(("final λ (used in the last step)", fmt(used)))
    facts.append(("final sparsity / target", f"{fmt(last_value(run, 'sparsity'))} / "
                                             f"{fmt(run.target_sparsity)}"
                  if run.target_sparsity is not None else "– (no routed experts)"))
    if sp:
        facts.append((f"sparsity after step {sp['skip_steps']} (mean ± std)",
                      f"{fmt(sp.get('mean'))} ± {fmt(sp.get('std'))}"))
    if st and fixed_sparsity(f["router"], st):
        facts.append(("settling time (stages I+II)", settling_cell(f["router"], st)))
    elif st:
        ends = [st["first_step"], st["stage2_start"], st["settle_step"]]
        if adaptive_lambda(f["router"]):  # (no stage II without a lambda: I then III)
            facts.append(("stages", f"I: {_span(ends[0], ends[1])}, II: "
                                    f"{_span(ends[1], ends[2])}, III: "
                                    + (f"from step {ends[2]}" if ends[2] is not None
                                       else "not reached")))
        facts.append(("settling time (stages I+II)",
                      f"{fmt(st['settling_time'])} steps (smoothed sparsity in the band "
                      f"±{st['tol']:g} from the settling step to the end, at least "
                      f"{st['window']} steps)"))
    sc = res.get("specialization")
    if sc:
        facts.append(("specialisation index / domain–expert MI",
                      f"{fmt(sc['index'])} / {fmt(sc['mi_bits'])} bits"))
    hm = res.get("heatmap")
    if hm:
        facts.append(("mean active experts per token (eval)", fmt(hm["mean_active_experts"])))
        facts.append((f"inactive experts ({hm.get('inactive_rule_text', '< 1/64 of tokens')})",
                      fmt(hm["num_inactive"])))
    al = res.get("allocation")
    if al and al.get("spearman_freq_active") is not None:
        facts.append(("Spearman(token frequency, active experts)",
                      fmt(al["spearman_freq_active"], 3)))
    parts.append(table(["quantity", "value"], [[esc(k), v] for k, v in facts], left=2))

    if run.evals and (run.evals[-1].get("domains") or len(run.evals) > 1):
        doms = sorted({d for e in run.evals for d in (e.get("domains") or {})})
        rows = [[e.get("step"), e.get("tokens")] + [(e.get("domains") or {}).get(d) for d in doms]
                + [e.get("val_loss")] for e in run.evals]
        parts.append(f"<h3>Validation loss per domain ({esc(val_label(run))})</h3>")
        parts.append(table(["step", "tokens"] + doms + ["all"], rows, left=0))

    for analysis, file, caption in FIGURES:
        p = out / file
        if analysis in res and p.is_file():
            parts.append(img(p, caption))
    al = res.get("allocation")
    if al:
        for rel in al.get("files", []):
            if rel.startswith("top_tokens_layer") and rel.endswith(".png") \
                    and (out / rel).is_file():
                parts.append(img(out / rel, "Tokens over-represented among each expert's "
                                            "tokens (Table 10): share of the expert's tokens "
                                            "and lift over the token's base frequency."))
    if res.get("skipped"):
        parts.append('<p class="note">Not available: ' + "; ".join(
            f"{esc(k)} ({esc(v)})" for k, v in res["skipped"].items()) + "</p>")
    if run.config:
        parts.append("<details><summary>config.yaml</summary><pre>"
                     + esc(yaml.safe_dump(run.config, sort_keys=False)) + "</pre></details>")
    return "\n".join(parts)


def _span(a: int | None, b: int | None) -> str:
    """Steps [a, b) as text (b None: to the end of the log)."""
    if a is None:
        return "not reached"
    if b is None:
        return f"from step {a}"
    return f"steps {a}–{b - 1}" if b > a else "empty"


# ----------------------------------------------------------------------------- facts of a run

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
