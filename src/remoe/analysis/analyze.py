"""The analyses of one run (and comparisons), each writing a PNG plus its numbers (CSV / JSON).

Log-based: ``stages`` (Fig. 4 + settling time), ``sparsity`` (Fig. 3 + Fig. 7d), ``flips``
(Appendix A). Model-based, all from one pass of the model over evaluation tokens
(:func:`routing_stats`, cached in ``routing_stats.npz``): ``heatmap`` (Fig. 7b/c),
``specialization`` (Fig. 8, App. G), ``allocation`` (Fig. 6, App. H, Table 10).
Definitions and file formats: docs/ANALYSIS.md.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from remoe.analysis import plots
from remoe.analysis.flips import FlipSeries, flip_series
from remoe.analysis.routing import INACTIVE_RATIO, RoutingStats, collect_routing_stats, spearman
from remoe.analysis.runlog import Run
from remoe.stages import (log10_span, SETTLE_TOL, SETTLE_WINDOW, SMOOTH, STAGE_EPS, Stages,
                                   band_excursions, centered_mean, detect_stages, mean_std_after)
from remoe.analysis.tokens import TokenNames
from remoe.errors import ConfigError

LOG_ANALYSES = ("stages", "sparsity", "flips")
MODEL_ANALYSES = ("heatmap", "specialization", "allocation")
ANALYSES = LOG_ANALYSES + MODEL_ANALYSES
STATS_FILE = "routing_stats.npz"


@dataclass
class Options:
    what: tuple[str, ...] = ANALYSES
    checkpoint: str | None = None  # model for the model-based analyses (default: the run's)
    data: str = "auto"  # see remoe.analysis.evaldata
    data_cache: str | None = None
    max_tokens: int = 65536
    batch_size: int = 8
    layers: list[int] | None = None  # default first, middle, last
    min_count: int = 5  # Table 10 / Fig. 6 token filter
    top_tokens: int = 8
    settle_tol: float = SETTLE_TOL
    settle_window: int = SETTLE_WINDOW
    stage_eps: float = STAGE_EPS  # stage II: lambda * L_reg >= eps * L_lm
    smooth: int = SMOOTH
    skip_steps: int = 100  # Fig. 3: mean/std exclude the first steps
    recompute: bool = False  # ignore a cached routing_stats.npz
    compare: list[str] = field(default_factory=list)


class Skip(Exception):
    """An analysis that cannot run on this run (the message says why)."""


# ----------------------------------------------------------------------------- small helpers

def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in r.items()})
    return path


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=2) + "\n")
    return path


def _fmt(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return "" if not math.isfinite(v) else f"{float(v):.6g}"
    return v


def _clean(o: Any) -> Any:
    """JSON-safe: numpy -> python, NaN/inf -> null."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.ndarray):
        return _clean(o.tolist())
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, Path):
        return str(o)
    return o


def _rel(paths: list[Path], out: Path) -> list[str]:
    return [str(p.relative_to(out)) if p.is_relative_to(out) else str(p) for p in paths]


# ----------------------------------------------------------------------------- log analyses

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
    # how far lambda swings once settled (decades; issue 11's limit-cycle measure)
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
    return {**rec, "files": _rel(files, out)}


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
    return {**rec, "files": _rel(files, out)}


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
                series[_unique(o.name, series)] = run_flips(o)
            except Skip as e:
                rec.setdefault("compare_skipped", {})[o.name] = str(e)
        rows = [{"run": name, **r} for name, fs in series.items() for r in fs.rows()]
        files.append(write_csv(out / "flips_compare.csv", rows))
        fig = plots.fig_flips({n: (fs.steps, fs.rates, fs.num_experts) for n, fs in series.items()},
                              "flip rate and flip count: " + " vs ".join(series))
        files.append(plots.save_png(fig, out / "flips_compare.png"))
        rec["compare"] = {n: flip_summary(fs) for n, fs in series.items()}
    return {**rec, "files": _rel(files, out)}


def _unique(name: str, taken) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name} ({i})", i + 1
    return out


# ----------------------------------------------------------------------------- model analyses

def _model_key(model_dir: Path) -> dict[str, Any]:
    w = model_dir / "model.safetensors"
    st = w.stat() if w.exists() else None
    return {"model_dir": str(model_dir.resolve()),
            "weights_mtime_ns": st.st_mtime_ns if st else None,
            "weights_bytes": st.st_size if st else None}


def routing_stats(run: Run, opts: Options, cache: Path | None) -> tuple[RoutingStats, TokenNames]:
    """The routing statistics of the run's model (one pass), reused from ``cache`` when it was
    made from the same weights, evaluation tokens, token budget and layers."""
    from remoe.analysis.evaldata import eval_tokens
    from remoe.loading import load_model, resolve_model_dir

    try:
        model_dir = resolve_model_dir(opts.checkpoint or run.path)
    except ConfigError as e:
        if opts.checkpoint:
            raise
        raise Skip(f"no model in the run ({e})") from None
    toks = eval_tokens(run, opts.data, batch_size=opts.batch_size, max_tokens=opts.max_tokens,
                       cache_dir=opts.data_cache)
    key = _clean({**_model_key(model_dir), "data": toks.source, "max_tokens": opts.max_tokens,
                  "layers": opts.layers})
    if cache is not None and cache.is_file() and not opts.recompute:
        try:
            stats = RoutingStats.load(cache)
        except (OSError, ValueError, KeyError):
            stats = None
        if stats is not None and stats.meta.get("key") == key:
            return stats, TokenNames(stats.meta.get("tokenizer"))
    model, tok = load_model(model_dir)
    if not model.config.is_moe:
        raise Skip(f"router={model.config.router!r} has no routed experts")
    stats = collect_routing_stats(model, toks.batches(), toks.domains, max_tokens=toks.limit,
                                  layers=opts.layers, seq_len=toks.seq_len,
                                  meta={"key": key, "data_source": toks.source, "tokenizer": tok,
                                        "router": model.config.router})
    if cache is not None:
        stats.save(cache)
    return stats, TokenNames(tok)


def layers_note(stats: RoutingStats, chosen: list[int] | None) -> str:
    """Which layers the per-layer figures show, said on the figure."""
    L = stats.num_layers
    shown = ", ".join(str(l) for l in stats.kept_layers)
    if len(stats.kept_layers) == L:
        return f"all {L} MoE layers shown"
    how = "chosen with --layers" if chosen is not None else "first, middle, last; --layers"
    return f"only layers {shown} of MoE layers 0-{L - 1} shown ({how})"


def _stats_title(run: Run, stats: RoutingStats) -> str:
    router = stats.meta.get("router", run.router)
    return f"{run.name} (router={router}, {stats.num_tokens:,} tokens)"


def analyze_heatmap(run: Run, stats: RoutingStats, out: Path) -> dict[str, Any]:
    ratio = stats.routed_ratio_LN()
    inactive = stats.inactive_LN()
    rows = [{"layer": l, "expert": e, "routed_ratio": ratio[l, e], "inactive": bool(inactive[l, e])}
            for l in range(stats.num_layers) for e in range(stats.num_routed)]
    files = [write_csv(out / "routed_ratio.csv", rows)]
    act = stats.active_experts_L()
    rec = {"num_tokens": stats.num_tokens, "inactive_threshold": INACTIVE_RATIO,
           "num_inactive": int(inactive.sum()), "active_experts_per_layer": act,
           "mean_active_experts": float(act.mean()), "target_active": stats.target_active,
           "max_ratio": float(ratio.max()), "min_ratio": float(ratio.min()),
           # load imbalance per layer: max / mean routed ratio (1 = perfectly balanced)
           "imbalance_per_layer": (ratio.max(1) / np.maximum(ratio.mean(1), 1e-12))}
    files.append(write_json(out / "routed_ratio.json", rec))
    fig = plots.fig_routed_heatmap(ratio, inactive, INACTIVE_RATIO,
                                   f"average routed tokens ratio\n{_stats_title(run, stats)}")
    files.append(plots.save_png(fig, out / "routed_ratio.png"))
    return {**rec, "files": _rel(files, out)}


def analyze_specialization(run: Run, stats: RoutingStats, out: Path,
                           layers: list[int] | None = None) -> dict[str, Any]:
    spec = stats.specialization()
    if spec["num_domains"] < 2:
        raise Skip(f"needs tokens of at least 2 domains, got {stats.domains} (use --data "
                   "validation or an .npz with domain_ids)")
    keep = stats.present_domains()
    names = [stats.domains[d] for d in keep]
    r = stats.domain_ratio_DLN()
    rows = [{"domain": stats.domains[d], "domain_tokens": int(stats.tokens_D[d]), "layer": l,
             "expert": e, "routed_ratio": r[d, l, e]}
            for d in keep for l in range(stats.num_layers) for e in range(stats.num_routed)]
    files = [write_csv(out / "specialization.csv", rows)]
    rec = {**spec, "domains": names,
           "domain_tokens": {stats.domains[d]: int(stats.tokens_D[d]) for d in keep},
           "layers_plotted": stats.kept_layers, "uniform_ratio": stats.uniform_ratio}
    files.append(write_json(out / "specialization.json", rec))
    title = (f"routed tokens ratio per domain: {_stats_title(run, stats)}\nspecialisation index "
             f"{spec['index']:.3f}, domain–expert MI {spec['mi_bits']:.3f} bits\n"
             f"{layers_note(stats, layers)}")
    fig = plots.fig_specialization(r[keep], names, stats.kept_layers, stats.uniform_ratio, title)
    files.append(plots.save_png(fig, out / "specialization.png"))
    return {**rec, "files": _rel(files, out)}


def analyze_allocation(run: Run, stats: RoutingStats, names: TokenNames, out: Path,
                       opts: Options) -> dict[str, Any]:
    files: list[Path] = []
    table = stats.token_table(min_count=opts.min_count)
    if table["token_id"].size == 0:
        table = stats.token_table(min_count=1)
    rho = spearman(table["frequency"], table["mean_active"])
    rows = [{"rank": i, "token_id": int(t), "token": names.text(int(t)), "count": int(c),
             "frequency": f, "mean_active": a,
             **{f"active_layer{l}": v for l, v in enumerate(la)}}
            for i, (t, c, f, a, la) in enumerate(zip(table["token_id"], table["count"],
                                                     table["frequency"], table["mean_active"],
                                                     table["layer_active"]))]
    files.append(write_csv(out / "token_allocation.csv", rows))
    fig = plots.fig_token_allocation(table, names, rho, stats.target_active,
                                     f"{run.name}: active experts vs token frequency")
    files.append(plots.save_png(fig, out / "allocation_tokens.png"))

    act = stats.domain_active_DL()
    keep = stats.present_domains()
    files.append(write_csv(out / "domain_allocation.csv", [
        {"domain": stats.domains[d], "domain_tokens": int(stats.tokens_D[d]), "layer": l,
         "mean_active_experts": act[d, l]} for d in keep for l in range(stats.num_layers)]))
    fig = plots.fig_domain_allocation(act[keep], stats.active_experts_L(),
                                      [stats.domains[d] for d in keep], stats.target_active,
                                      f"domain-level expert allocation\n"
                                      f"{_stats_title(run, stats)}")
    files.append(plots.save_png(fig, out / "allocation_domains.png"))

    top_rows, top_json = [], {}
    for l in stats.kept_layers:
        per_expert = stats.top_tokens(l, top=opts.top_tokens, min_count=opts.min_count)
        top_json[str(l)] = [[{**it, "token": names.text(it["token_id"])} for it in items]
                            for items in per_expert]
        for e, items in enumerate(per_expert):
            for rank, it in enumerate(items):
                top_rows.append({"layer": l, "expert": e, "rank": rank, "token_id": it["token_id"],
                                 "token": names.text(it["token_id"]), "count": it["count"],
                                 "routed": it["routed"], "prob": it["prob"],
                                 "share": it["share"], "base": it["base"], "lift": it["lift"]})
        fig = plots.fig_top_tokens(per_expert, l, names,
                                   f"{run.name}: tokens over-represented in each expert of layer "
                                   f"{l} (ranked by share − base frequency; occurrences >= "
                                   f"{opts.min_count})", top=opts.top_tokens,
                                   expert_ratio=stats.expert_ratio(l),
                                   note=layers_note(stats, opts.layers))
        files.append(plots.save_png(fig, out / f"top_tokens_layer{l}.png"))
    files.append(write_csv(out / "top_tokens.csv", top_rows))
    rec = {"num_tokens_listed": int(table["token_id"].size), "min_count": opts.min_count,
           "layers_plotted": stats.kept_layers, "num_layers": stats.num_layers,
           "top_tokens_statistic": "share - base (lift = share / base > 1)",
           "spearman_freq_active": rho,
           "domain_active_experts": {stats.domains[d]: act[d] for d in keep},
           "domain_spread_per_layer": (np.nanmax(act[keep], 0) - np.nanmin(act[keep], 0)),
           "top_tokens": top_json, "tokenizer": names.available}
    files.append(write_json(out / "allocation.json", rec))
    return {**{k: v for k, v in rec.items() if k != "top_tokens"}, "files": _rel(files, out)}


# ----------------------------------------------------------------------------- all of it

def fingerprint(run: Run, opts: Options) -> dict[str, Any]:
    """What the outputs depend on: the run's files (size, mtime), the mask files, the model
    weights (for the model-based analyses) and the options."""
    from remoe.loading import resolve_model_dir

    files: dict[str, Any] = {}
    for name in ("metrics.jsonl", "eval.jsonl", "summary.json", "config.yaml"):
        p = run.path / name
        files[name] = [p.stat().st_size, p.stat().st_mtime_ns] if p.is_file() else None
    files["routing"] = [[s, p.stat().st_size] for s, p in run.mask_files()]
    model = None
    if any(w in opts.what for w in MODEL_ANALYSES):
        try:
            model = _model_key(resolve_model_dir(opts.checkpoint or run.path))
        except ConfigError:
            pass
    options = {k: v for k, v in asdict(opts).items() if k != "recompute"}
    return _clean({"files": files, "model": model, "options": options})


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
                attempt("heatmap", analyze_heatmap, run, stats, out)
            if "specialization" in opts.what:
                attempt("specialization", analyze_specialization, run, stats, out, opts.layers)
            if "allocation" in opts.what:
                attempt("allocation", analyze_allocation, run, stats, names, out, opts)
    write_json(out / "analysis.json", result)
    return _clean(result)


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
