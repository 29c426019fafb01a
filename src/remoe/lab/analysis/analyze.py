"""The analyses of one run (and comparisons), each writing a PNG plus its numbers (CSV / JSON).

Log-based, here: ``stages`` (Fig. 4 + settling time), ``sparsity`` (Fig. 3 + Fig. 7d),
``flips`` (Appendix A, from the recorded routing masks), ``experts`` (expert use per layer,
:mod:`remoe.lab.analysis.expertuse`). Model-based, all from one pass of the model over evaluation
tokens (:mod:`remoe.lab.analysis.model_analyses`, cached in ``routing_stats.npz``): ``heatmap``
(Fig. 7b/c), ``specialization`` (Fig. 8, App. G), ``allocation`` (Fig. 6, App. H, Table 10); and
``gates`` (gate scale and the FFN's share of the residual stream,
:mod:`remoe.lab.analysis.gates`). :func:`analyze` runs them; names, :class:`Options`,
:class:`Skip` and the writers are in :mod:`remoe.lab.analysis.common`. Definitions and file
formats: docs/ANALYSIS.md.

Routing stability (``flips``): for masks M_i^l in {0,1}^{T x N} of every MoE layer l on the
run's fixed calibration set,

    flip rate_i  = sum_l || vec(M_i^l - M_{i-1}^l) ||_1 / (L * T * N)
    flip count_i = N * flip rate_i

N is the number of routed experts E*G. ``i-1`` is the previous *recorded* mask, so with
``analysis.record_masks_every = r`` a point measures the change over r optimizer steps
(the paper records every step; the gap is kept in the CSV as ``step_gap``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remoe.errors import ConfigError
from remoe.lab.analysis import plots
from remoe.lab.analysis.common import (ANALYSES, HOOK_ANALYSES, MODEL_ANALYSES, STATS_FILE,
                                       Options, Skip, json_safe, rel_files, rule_text, write_csv,
                                       write_json)
from remoe.lab.analysis.expertuse import layer_rows, run_expert_use
from remoe.lab.analysis.gates import analyze_gates
from remoe.lab.analysis.model_analyses import (analyze_allocation, analyze_heatmap,
                                               analyze_specialization, model_key, routing_stats)
from remoe.lab.analysis.runlog import Run, load_masks
from remoe.method.stages import (Stages, band_excursions, centered_mean, detect_stages, log10_span,
                                 mean_std_after)


def fingerprint(run: Run, opts: Options) -> dict[str, Any]:
    """What the outputs depend on: the run's files (size, mtime), the mask files, the model
    weights (for the model-based analyses) and the options."""
    from remoe.rundir.loading import resolve_model_dir

    files: dict[str, Any] = {}
    for name in ("metrics.jsonl", "metrics.jsonl.gz", "eval.jsonl", "summary.json",
                 "config.yaml", "run.zip"):
        p = run.path / name
        files[name] = [p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else None
    files["routing"] = [[s, m.size] for s, m in run.mask_files()]
    model = None
    if any(w in opts.what for w in MODEL_ANALYSES + HOOK_ANALYSES):
        try:
            model = model_key(resolve_model_dir(opts.checkpoint or run.path))
        except ConfigError:
            pass
    options = {k: v for k, v in asdict(opts).items() if k != "recompute"}
    return json_safe({"files": files, "model": model, "options": options})


def analyze(run: Run, out: Path, opts: Options, log=print, reuse: bool = False) -> dict[str, Any]:
    """Run ``opts.what`` on ``run`` into ``out``; returns (and writes ``analysis.json``) a dict
    analysis -> numbers and files, plus ``skipped``: analysis -> reason.

    ``reuse``: return the previous ``analysis.json`` untouched when it was made from the same
    inputs and options (:func:`fingerprint`) and its files are all there.
    """
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(run, opts)
    if reuse and not opts.recompute:
        prev = _read_result(out / "analysis.json")
        if prev is not None and prev.get("fingerprint") == fp and all(
                (out / f).is_file() for name in ANALYSES if isinstance(prev.get(name), dict)
                for f in prev[name].get("files", [])):
            log(f"  up to date: {out / 'analysis.json'}")
            return prev
    others = [Run(p) for p in opts.compare]
    result: dict[str, Any] = {"run": str(run.path), "name": run.name, "skipped": {},
                              "fingerprint": fp}

    def attempt(name, fn, *a):
        try:
            result[name] = fn(*a)
            log(f"  {name:<15} " + ", ".join(result[name]["files"]))
        except Skip as e:
            result["skipped"][name] = str(e)
            log(f"  {name:<15} skipped: {e}")

    if "stages" in opts.what:
        attempt("stages", analyze_stages, run, out, opts)
    if "sparsity" in opts.what:
        attempt("sparsity", analyze_sparsity, run, out, opts)
    if "flips" in opts.what:
        attempt("flips", analyze_flips, run, out, opts, others)
    if "experts" in opts.what:
        attempt("experts", analyze_expert_use, run, out, opts)
    if any(w in opts.what for w in MODEL_ANALYSES):
        try:
            stats, names = routing_stats(run, opts, out / STATS_FILE)
        except Skip as e:
            for w in MODEL_ANALYSES:
                if w in opts.what:
                    result["skipped"][w] = str(e)
            log(f"  {'routing':<15} skipped: {e}")
        else:
            result["routing"] = {"num_tokens": stats.num_tokens, "domains": stats.domains,
                                 "data_source": stats.meta.get("data_source"),
                                 "model_dir": stats.meta.get("key", {}).get("model_dir")}
            if "heatmap" in opts.what:
                attempt("heatmap", analyze_heatmap, run, stats, out, opts.inactive_rule)
            if "specialization" in opts.what:
                attempt("specialization", analyze_specialization, run, stats, out, opts.layers)
            if "allocation" in opts.what:
                attempt("allocation", analyze_allocation, run, stats, names, out, opts)
    if "gates" in opts.what:
        attempt("gates", analyze_gates, run, out, opts, others)
    result = merge_previous(_read_result(out / "analysis.json"), result)
    write_json(out / "analysis.json", result)
    return json_safe(result)


def merge_previous(prev: dict[str, Any] | None, result: dict[str, Any]) -> dict[str, Any]:
    """``analysis.json`` is updated, never replaced by a poorer result: an analysis not run now,
    or skipped now, keeps its earlier numbers (of the same run); ``skipped`` then lists only
    what has no numbers. ``kept`` names the analyses whose numbers are earlier ones."""
    if not isinstance(prev, dict) or prev.get("run") != result.get("run"):
        return result
    kept = []
    for name in (*ANALYSES, "routing"):
        if not isinstance(result.get(name), dict) and isinstance(prev.get(name), dict):
            result[name] = prev[name]
            kept.append(name)
    skipped = {**(prev.get("skipped") or {}), **result["skipped"]}
    result["skipped"] = {k: v for k, v in skipped.items() if not isinstance(result.get(k), dict)}
    if kept:
        result["kept"] = kept
    return result


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def compute_stages(run: Run, opts: Options) -> Stages:
    m = run.metrics
    if not len(m) or not m.has("sparsity"):
        raise Skip("metrics.jsonl has no sparsity")
    target = run.target_sparsity
    if target is None:
        raise Skip(f"no target sparsity (router={run.router}: not an MoE run?)")
    return detect_stages(m.steps, m["sparsity"], target, m["lambda"] * m["reg_loss"],
                         m["lm_loss"], tol=opts.settle_tol, window=opts.settle_window,
                         eps=opts.stage_eps, smooth=opts.smooth)


def analyze_stages(run: Run, out: Path, opts: Options) -> dict[str, Any]:
    st = compute_stages(run, opts)
    m = run.metrics
    lam, reg, lm = m["lambda"], m["reg_loss"], m["lm_loss"]
    stage = st.stage_of(m.steps)
    rows = [{"step": int(s), "sparsity": m["sparsity"][i], "lambda": lam[i], "reg_loss": reg[i],
             "lm_loss": lm[i], "lambda_reg": lam[i] * reg[i], "stage": int(stage[i])}
            for i, s in enumerate(m.steps)]
    files = [write_csv(out / "stages.csv", rows)]
    rec = {**st.to_dict(), "router": run.router,
           # runs of (smoothed) records out of the band after the first entry: the settling
           # step comes after the last of them
           "band_excursions": band_excursions(m.steps, centered_mean(m["sparsity"], st.smooth),
                                              st.target, st.tol)}
    for k, name in ((1, "stage1"), (2, "stage2"), (3, "stage3")):
        sel = stage == k
        rec[f"{name}_steps"] = int(sel.sum())
        rec[f"{name}_mean_sparsity"] = float(np.nanmean(m["sparsity"][sel])) if sel.any() else None
    # how far lambda swings once settled (decades; the limit-cycle measure of docs/CONTROL.md)
    third = stage == 3
    rec["lambda_log10_amplitude_stage3"] = log10_span(lam[third])
    lam_SL = m.per_layer("lambda_layers")  # per-layer control ([steps, 0] otherwise)
    if lam_SL.size:
        rec["lambda_layers_log10_amplitude_stage3"] = [log10_span(c[third]) for c in lam_SL.T]
    files.append(write_json(out / "stages.json", rec))
    fig = plots.fig_stages(m.steps, m["sparsity"], lam, reg, lm, st,
                           f"{run.name}: three-stage training (router={run.router})",
                           lam_SL=lam_SL if lam_SL.size else None)
    files.append(plots.save_png(fig, out / "stages.png"))
    return {**rec, "files": rel_files(files, out)}


def sparsity_skip(run: Run, opts: Options, st: Stages | None) -> int:
    """Steps excluded from the mean/std: ``skip_steps``, or the settling step (else 0) when
    the run is not longer than that."""
    last = int(run.metrics.steps[-1])
    if opts.skip_steps < last:
        return opts.skip_steps
    return st.settle_step - 1 if st is not None and st.settle_step is not None else 0


def analyze_sparsity(run: Run, out: Path, opts: Options) -> dict[str, Any]:
    m = run.metrics
    st = compute_stages(run, opts)  # skips runs without sparsity or target, as this needs
    target = st.target
    skip = sparsity_skip(run, opts, st)
    mean, std, n = mean_std_after(m.steps, m["sparsity"], skip)
    fig = plots.fig_sparsity(m.steps, m["sparsity"], target, skip, mean, std,
                             f"{run.name}: sparsity $S_i$ (router={run.router})")
    files = [plots.save_png(fig, out / "sparsity.png")]
    layer = m.layer_sparsity()
    L = layer.shape[1]
    per_layer = [mean_std_after(m.steps, layer[:, l], skip) for l in range(L)]
    lmean = np.array([x[0] for x in per_layer])
    lstd = np.array([x[1] for x in per_layer])
    if L:
        final = layer[-1]
        files.append(write_csv(out / "layer_sparsity.csv", [
            {"layer": l, "mean": lmean[l], "std": lstd[l], "final": final[l]} for l in range(L)]))
        fig = plots.fig_layer_sparsity(m.steps, layer, target, skip, lmean, lstd,
                                       f"{run.name}: sparsity per layer")
        files.append(plots.save_png(fig, out / "layer_sparsity.png"))
    rec = {"target": target, "skip_steps": skip, "mean": mean, "std": std, "num_steps": n,
           "final": float(m["sparsity"][-1]), "layer_mean": lmean, "layer_std": lstd,
           "layer_spread": float(np.nanmax(lmean) - np.nanmin(lmean)) if L else None}
    files.append(write_json(out / "sparsity.json", rec))
    return {**rec, "files": rel_files(files, out)}


def flip_rate(prev_LTN: np.ndarray, cur_LTN: np.ndarray) -> float:
    """Fraction of (layer, token, expert) activation states that differ."""
    prev, cur = np.asarray(prev_LTN, dtype=bool), np.asarray(cur_LTN, dtype=bool)
    if prev.shape != cur.shape:
        raise ValueError(f"mask shapes differ: {prev.shape} vs {cur.shape}")
    return float(np.count_nonzero(prev ^ cur)) / max(prev.size, 1)


def layer_flip_rates(prev_LTN: np.ndarray, cur_LTN: np.ndarray) -> np.ndarray:
    """[L] flip rate of each layer."""
    x = np.asarray(prev_LTN, dtype=bool) ^ np.asarray(cur_LTN, dtype=bool)
    return x.reshape(x.shape[0], -1).mean(1)


@dataclass
class FlipSeries:
    """Flip rates between consecutive recorded masks of one run."""

    num_experts: int = 0  # N
    steps: list[int] = field(default_factory=list)  # the later step of each pair
    prev_steps: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    layer_rates: list[list[float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why a pair was not compared

    @property
    def counts(self) -> list[float]:
        return [self.num_experts * r for r in self.rates]

    def rows(self) -> list[dict]:
        out = []
        for a, b, r, lr in zip(self.prev_steps, self.steps, self.rates, self.layer_rates):
            row = {"step": b, "prev_step": a, "step_gap": b - a, "flip_rate": r,
                   "flip_count": self.num_experts * r}
            row.update({f"flip_rate_layer{l}": v for l, v in enumerate(lr)})
            out.append(row)
        return out


def flip_series(mask_files: list[tuple[int, Path]]) -> FlipSeries:
    """Flip rates over a run's ``(step, masks_<step>.npz)`` files (sorted by step).

    A pair is skipped (and said why) when the calibration tokens or the mask shapes differ.
    Only two mask files are held in memory at a time.
    """
    series = FlipSeries()
    prev = None
    for step, path in mask_files:
        masks, tokens, _ = load_masks(path)
        series.num_experts = int(masks.shape[-1])
        if prev is not None:
            pstep, pmasks, ptokens = prev
            if pmasks.shape != masks.shape:
                series.skipped.append(f"steps {pstep}->{step}: mask shape {pmasks.shape} -> "
                                      f"{masks.shape}")
            elif not np.array_equal(ptokens, tokens):
                series.skipped.append(f"steps {pstep}->{step}: calibration tokens differ")
            else:
                series.prev_steps.append(pstep)
                series.steps.append(step)
                series.rates.append(flip_rate(pmasks, masks))
                series.layer_rates.append(layer_flip_rates(pmasks, masks).tolist())
        prev = (step, masks, tokens)
    return series


def run_flips(run: Run) -> FlipSeries:
    files = run.mask_files()
    if len(files) < 2:
        raise Skip(f"needs at least 2 routing/masks_*.npz files, found {len(files)}")
    s = flip_series(files)
    if not s.rates:
        raise Skip("no comparable pair of mask files: " + "; ".join(s.skipped))
    return s


def flip_summary(s: FlipSeries) -> dict[str, Any]:
    rates = np.asarray(s.rates)
    half = rates[rates.size // 2:]
    return {"num_experts": s.num_experts, "num_pairs": int(rates.size),
            "mean_flip_rate": float(rates.mean()),
            "mean_flip_count": float(rates.mean()) * s.num_experts,
            "second_half_mean_flip_rate": float(half.mean()),
            "final_flip_rate": float(rates[-1]), "skipped_pairs": s.skipped}


def analyze_flips(run: Run, out: Path, opts: Options, others: list[Run]) -> dict[str, Any]:
    s = run_flips(run)
    files = [write_csv(out / "flips.csv", s.rows())]
    rec = flip_summary(s)
    files.append(write_json(out / "flips.json", rec))
    fig = plots.fig_flips({run.name: (s.steps, s.rates, s.num_experts)},
                          f"{run.name}: routing stability on the calibration set")
    files.append(plots.save_png(fig, out / "flips.png"))
    if others:
        series = {run.name: s}
        for o in others:
            try:
                series[unique_name(o.name, series)] = run_flips(o)
            except Skip as e:
                rec.setdefault("compare_skipped", {})[o.name] = str(e)
        rows = [{"run": name, **r} for name, fs in series.items() for r in fs.rows()]
        files.append(write_csv(out / "flips_compare.csv", rows))
        fig = plots.fig_flips({n: (fs.steps, fs.rates, fs.num_experts) for n, fs in series.items()},
                              "flip rate and flip count: " + " vs ".join(series))
        files.append(plots.save_png(fig, out / "flips_compare.png"))
        rec["compare"] = {n: flip_summary(fs) for n, fs in series.items()}
    return {**rec, "files": rel_files(files, out)}


def unique_name(name: str, taken) -> str:
    """``name``, or ``name (2)``, ``name (3)``, ... when ``taken`` has it."""
    out, i = name, 2
    while out in taken:
        out, i = f"{name} ({i})", i + 1
    return out


def analyze_expert_use(run: Run, out: Path, opts: Options) -> dict[str, Any]:
    """Per layer: experts per token, effective and never-firing experts (last 10% of the
    training steps), no-expert share and inactive experts (last calibration masks)."""
    recorded = [s for s, _ in run.mask_files()]
    if opts.mask_step is not None and opts.mask_step not in recorded:  # as `domains` does
        raise Skip(f"no routing masks of step {opts.mask_step} (recorded: "
                   f"{', '.join(map(str, recorded)) or 'none'})")
    use = run_expert_use(run, opts.inactive_rule, step=opts.mask_step)
    if use is None:
        raise Skip(f"no expert counts or routing masks (router={run.router}: not an MoE run?)")
    rows = layer_rows(use)
    files = [write_csv(out / "expert_use.csv", rows)]
    rec = {**use, "inactive_rule_text": rule_text(opts.inactive_rule), "layers": rows}
    files.append(write_json(out / "expert_use.json", rec))
    return {**rec, "files": rel_files(files, out)}
