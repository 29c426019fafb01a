"""The analyses of one run (and comparisons), each writing a PNG plus its numbers (CSV / JSON).

Log-based: ``stages`` (Fig. 4 + settling time), ``sparsity`` (Fig. 3 + Fig. 7d), ``flips``
(Appendix A), ``experts`` (expert use per layer, :mod:`remoe.lab.analysis.expertuse`). Model-based, all from one pass of the model over evaluation tokens
(:func:`routing_stats`, cached in ``routing_stats.npz``): ``heatmap`` (Fig. 7b/c),
``specialization`` (Fig. 8, App. G), ``allocation`` (Fig. 6, App. H, Table 10); and ``gates``
(gate scale and the FFN's share of the residual stream, :mod:`remoe.lab.analysis.gates`).
Definitions and file formats: docs/ANALYSIS.md.

Parts: :mod:`remoe.lab.analysis.common` (names, :class:`Options`, :class:`Skip`, writers),
:mod:`remoe.lab.analysis.log_analyses`, :mod:`remoe.lab.analysis.model_analyses`; this module runs
them (:func:`analyze`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from remoe.lab.analysis.common import (ANALYSES, HOOK_ANALYSES, MODEL_ANALYSES, STATS_FILE,
                                       Options, Skip, json_safe, write_json)
from remoe.lab.analysis.gates import analyze_gates
from remoe.lab.analysis.log_analyses import (analyze_expert_use, analyze_flips, analyze_sparsity,
                                             analyze_stages)
from remoe.lab.analysis.model_analyses import (analyze_allocation, analyze_heatmap,
                                               analyze_specialization, model_key, routing_stats)
from remoe.lab.analysis.runlog import Run
from remoe.errors import ConfigError


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
