"""The analyses read from a run's logs: ``stages`` (Fig. 4 + settling time), ``sparsity``
(Fig. 3 + Fig. 7d), ``flips`` (Appendix A, from the recorded routing masks) and ``experts``
(expert use per layer, :mod:`remoe.lab.analysis.expertuse`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from remoe.lab.analysis import plots
from remoe.lab.analysis.common import Options, Skip, rel_files, write_csv, write_json
from remoe.lab.analysis.expertuse import layer_rows, run_expert_use
from remoe.lab.analysis.flips import FlipSeries, flip_series
from remoe.lab.analysis.inactive import rule_text
from remoe.lab.analysis.runlog import Run
from remoe.method.stages import (Stages, band_excursions, centered_mean, detect_stages, log10_span,
                                 mean_std_after)


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
    return {**rec, "files": rel_files(files, out)}


def _unique(name: str, taken) -> str:
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
