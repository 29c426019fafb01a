"""``remoe study SPEC.yaml``: a grid of training runs from one YAML, resumable, with tables.

    remoe study configs/study/table2.yaml --dry-run        # the runs and their estimated cost
    remoe study configs/study/table2.yaml --jobs 2         # run (again: continues), then tables
    remoe study configs/study/table2.yaml --results-only   # rebuild results.* and report.html

Outputs in ``--out`` (default: the spec's ``out``, else ``studies/<spec name>``):
``runs/<name>/`` (each a ``remoe train`` run), ``configs/<name>.yaml``, ``logs/<name>.log``,
``study.json``, ``results.csv``, ``results.md``, ``report.html``. See docs/STUDY.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from pathlib import Path

from remoe.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML (see docs/STUDY.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs with their stop rule and estimated CPU time; run nothing")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once; each gets max(1, cores // jobs) threads (default 1)")
    p.add_argument("--out", default=None, help="study directory (default: the spec's out, else "
                                               "studies/<spec name>)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only these runs (names, labels or groups; shell patterns allowed); "
                        "the runs they match FLOPs with are added")
    p.add_argument("--reuse", nargs="+", default=(), metavar="DIR",
                   help="other study directories: a run whose experiment (config minus run name "
                        "and directory, seed included) finished there is taken over (hard-linked) "
                        "instead of trained again")
    p.add_argument("--results-only", action="store_true",
                   help="rebuild results.csv / results.md / report.html without running")
    p.add_argument("--no-report", action="store_true", help="do not build report.html")
    p.add_argument("--gflops", type=float, default=None,
                   help="--dry-run: one-thread GEMM GFLOP per CPU second to estimate with, instead "
                        "of measuring it (the probe varies with the load of a shared machine)")


def _select(spec, patterns: list[str] | None) -> set[str] | None:
    if patterns is None:
        return None
    chosen = set()
    for pat in patterns:
        hit = {r.name for r in spec.runs
               if any(fnmatch.fnmatchcase(x, pat) for x in (r.name, r.label, r.group))}
        if not hit:
            raise ConfigError(f"--only {pat!r} matches no run, label or group of the study")
        chosen |= hit
    return chosen


def _fmt_s(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def model_of_source(study, r, cfg: dict) -> dict:
    """The config to cost ``r`` with: for a run that starts from a study run's weights
    (``init_from_run``), that run's model with ``r``'s model overrides (the shape comes from
    the source, as in training); otherwise ``cfg`` itself."""
    if r.init_of is None:
        return cfg
    src = study.spec.by_name()[r.init_of]
    model_of = model_of_source(study, src, src.config)["model"]
    out = {**cfg, "model": {**model_of, **cfg.get("model", {})},
           "train": {k: v for k, v in cfg.get("train", {}).items() if k != "init_from"}}
    return out


def dry_run(study, log=print, gflops: float | None = None) -> dict:
    """Print the runs and the estimated CPU time; returns the totals."""
    from remoe.lab.study import estimate
    from remoe.lab.study.runner import cores
    from remoe.lab.study.runs import apply_stop, read_json, same_experiment

    if gflops is not None and not gflops > 0:
        raise ConfigError(f"--gflops={gflops} must be > 0")
    measured = gflops is None
    gflops = estimate.probe_gflops() if measured else gflops
    flops_of: dict[str, float] = {}
    rows, todo, total_s, total_flops = [], [], 0.0, 0.0
    summaries = {r.name: s for r in study.spec.runs if (s := study.summary(r)) is not None}
    finished = []  # every finished run calibrates the rate, selected or not
    for r in study.spec.runs:
        if r.name in summaries:
            flops_of[r.name] = float(summaries[r.name].get("flops") or 0.0)
            finished.append((flops_of[r.name], float(summaries[r.name].get("elapsed_s") or 0.0),
                             _run_threads(study.run_dir(r))))
    elsewhere = study.finished_elsewhere() if study.reuse else []
    for r in study.selected():
        summary = summaries.get(r.name)
        if summary is not None:
            rows.append((r, "done", summary.get("steps"), flops_of[r.name], 0.0))
            continue
        match = (sum(flops_of[d] for d in r.match_of)
                 if r.match_of and all(d in flops_of for d in r.match_of) else None)
        cfg = apply_stop(r, study.runs_dir, study.threads, match)
        want = same_experiment(cfg) if elsewhere else None
        src = next((p for p, c in elsewhere if c == want), None)
        if src is not None and not study.has_checkpoint(r):
            summary = read_json(src / "summary.json") or {}
            flops_of[r.name] = float(summary.get("flops") or 0.0)
            rows.append((r, "reuse", summary.get("steps"), flops_of[r.name], 0.0))
            continue
        cost = estimate.estimate_flops(model_of_source(study, r, cfg))
        flops_of[r.name] = cost.flops
        secs = estimate.cpu_seconds(cost, gflops)
        todo.append(cost)
        total_s += secs
        total_flops += cost.flops + cost.extra_flops
        state = "resume" if study.has_checkpoint(r) else "to run"
        rows.append((r, state, cost.steps, cost.flops, secs))
    w = max((len(r.name) for r, *_ in rows), default=4)
    log(f"study {study.spec.name} ({study.spec.path}): {len(rows)} runs -> {study.out}")
    log(f"budget (spec): {study.spec.budget}")
    log(f"{'run':<{w}}  {'state':<6}  {'steps':>6}  {'FLOPs':>9}  {'est. CPU':>9}  stop; overrides")
    for r, state, steps, flops, secs in rows:
        log(f"{r.name:<{w}}  {state:<6}  {steps if steps is not None else '?':>6}  {flops:>9.3g}  "
            f"{_fmt_s(secs) if state not in ('done', 'reuse') else '-':>9}  {r.describe_stop()}; "
            f"{r.describe_overrides() or '-'}")
    wall = total_s / min(study.jobs, cores())
    log(f"total to run: {total_flops:.3g} FLOPs, estimated {_fmt_s(total_s)} of CPU "
        f"(~{_fmt_s(wall)} wall with --jobs {study.jobs} on {cores()} cores); "
        f"{'probe' if measured else 'given'} {gflops:.1f} GFLOP/CPU-s x efficiency "
        f"{estimate.EFFICIENCY} + {estimate.RUN_OVERHEAD_CPU_S:.0f} CPU-s per run "
        "(remoe.lab.study.estimate)")
    rate = estimate.achieved_rate(finished)
    calibrated = None
    if rate is not None and todo:
        n_threads = study.threads * min(study.jobs, len(todo))
        calibrated = sum(estimate.thread_seconds(c, rate) for c in todo) / n_threads
        log(f"at the rate this study's {len(finished)} finished run(s) reached ({rate:.1f} GFLOP "
            f"per thread-second of training, under the load they ran with): ~{_fmt_s(calibrated)} "
            f"wall with --jobs {study.jobs} x {study.threads} thread(s)")
    if study.spec.eval_tasks:
        n_eval = sum(not study.done(r) for r, *_ in rows)
        log(f"then zero-shot tasks ({study.spec.eval_tasks}"
            f"{f', at most {study.spec.eval_limit} examples each' if study.spec.eval_limit else ''}"
            f") on {n_eval} run(s) without them: `remoe eval"
            f"{'' if study.spec.eval_loss else ' --no-loss'}`, not in the estimate")
    return {"runs": len(rows), "cpu_s": total_s, "flops": total_flops, "wall_s": wall,
            "achieved_gflops": rate, "calibrated_wall_s": calibrated}


def _run_threads(run_dir: Path) -> int:
    """The threads a finished run trained with (its last metrics record), else 1."""
    from remoe.rundir.files import read_jsonl

    path = run_dir / "metrics.jsonl"
    good = read_jsonl(path)[0] if path.is_file() else []
    return int(good[-1][1].get("threads") or 1) if good else 1


def export_finished(study, log=print) -> list[str]:
    """Copy every run finished (and evaluated) in the study directory to the spec's
    ``results:`` directory where the copy is missing or older (:meth:`Study.copy_to_results`);
    returns the names copied."""
    from remoe.lab.study.archive import pack_committed

    copied = [r.name for r in study.spec.runs if study.copy_to_results(r)]
    if copied:
        log(f"committed copies: {', '.join(copied)} -> {study.spec.results_dir / 'runs'} "
            "(git add them)")
    packed = [r.name for r in study.spec.runs
              if (d := study.committed(r)) is not None and pack_committed(d)]
    if packed:
        log(f"committed copies packed into run.zip: {', '.join(packed)} (git add -A them)")
    return copied


def _report(study, log=print) -> Path | None:
    from remoe.fileio import atomic_write_text
    from remoe.lab.analysis.analyze import Options
    from remoe.lab.analysis.report import ReportOptions, build_report

    done = [study.source_dir(r) for r in study.spec.runs if study.summary(r) is not None]
    if not done:
        log("report: no finished run yet")
        return None
    out = study.out / "report.html"
    extra = ()
    curves_png = study.out / "curves.png"
    if curves_png.is_file():
        from remoe.lab.analysis.report_html import img

        extra = ('<h2 id="curves">Learning curves</h2>'
                 + img(curves_png.read_bytes(), "validation loss against tokens and training "
                       "FLOPs; shaded: range over seeds (results.md: crossovers)"),)
    # analyses go below the study directory, never into committed run copies
    html = build_report([str(p) for p in done],
                        ReportOptions(analysis=Options(), title=f"remoe study {study.spec.name}",
                                      analysis_root=study.out / "analysis", extra_html=extra),
                        log=lambda m: None)
    atomic_write_text(out, html)
    return out


def run(args: argparse.Namespace) -> int:
    from remoe.lab.study.runner import STATE_FILE, Study
    from remoe.lab.study.results import write_results
    from remoe.lab.study.spec import load_spec

    if args.jobs < 1:
        raise ConfigError(f"--jobs={args.jobs} must be >= 1")
    spec = load_spec(args.spec)  # expands and validates every run before anything starts
    out = Path(args.out or spec.out or Path("studies") / spec.name)
    for d in args.reuse:
        if not Path(d).is_dir():
            raise ConfigError(f"--reuse {d!r}: not a directory")
    study = Study(spec, out, jobs=args.jobs, only=_select(spec, args.only),
                  reuse=tuple(Path(d) for d in args.reuse))
    if args.dry_run:
        dry_run(study, gflops=args.gflops)
        return 0
    status = 0
    committed = [r for r in spec.runs if study.committed(r) is not None]
    if args.results_only and not (out / "runs").is_dir() and not committed:
        raise ConfigError(f"--out={str(out)!r} holds no study runs (no runs/ directory) and the "
                          "spec has no committed runs (results:): run the study first, or give "
                          "the --out it ran with")
    if not args.results_only:
        status = study.run()
    export_finished(study)
    state = None
    if (out / STATE_FILE).is_file():
        state = json.loads((out / STATE_FILE).read_text())
    csv_path, md_path, rows = write_results(spec, out, state)
    done = sum(r.get("state") == "done" for r in rows)
    print(f"results: {md_path} and {csv_path} ({done} of {len(rows)} runs finished)")
    if spec.report and not args.no_report:
        try:
            path = _report(study)
        except (ConfigError, OSError, ValueError, RuntimeError) as e:
            print(f"remoe study: report failed: {e}")
            return status or 1
        if path is not None:
            print(f"report: {path}")
    return status
