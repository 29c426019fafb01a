#!/usr/bin/env python3
"""When does a router's loss gap to a reference open, and does it follow the L1 penalty?

    python scripts/gap_timeline.py results/long_micro --pairs relu:topk relu_rec:topk \
        --seeds 0 1 --out results/long_micro/gap_timeline.json

Reads only committed run outputs (``metrics.jsonl`` and ``eval.jsonl`` of each
``STUDY/runs/RUN/run.zip``, or of the run directory). For each pair ``a:b`` and seed ``s`` it compares run ``a-s<s>`` with run
``b-s<s>`` over windows of ``--window`` steps:

- train LM loss gap: the mean over the window of ``lm_loss(a) - lm_loss(b)`` at the same step
  (the same batches: the runs share the data order per seed);
- validation gap: ``val_loss(a) - val_loss(b)`` on the fixed validation sample at the window's
  last step (where both runs evaluated there);
- for run ``a``: the mean lambda, the penalty's share of the objective ``(loss - lm_loss) /
  loss``, the sparsity and the learning rate at the window's first step.

It then compares two phases (``--early``, ``--late``: the windows inside each): the mean gap and
the mean penalty share in each, and their changes. The question: does the gap grow as the
penalty's share does (docs/RESULTS.md, "Why ReMoE trails on the micro preset").
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from remoe.lab.analysis.runlog import run_jsonl


def _metrics(run_dir: Path) -> list[dict]:
    return run_jsonl(run_dir, "metrics.jsonl")


def _evals(run_dir: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["val_loss"]) for row in run_jsonl(run_dir, "eval.jsonl")}


def timeline(runs: Path, a: str, b: str, window: int) -> dict:
    ma, mb = _metrics(runs / a), _metrics(runs / b)
    ea, eb = _evals(runs / a), _evals(runs / b)
    by_step_b = {int(r["step"]): r for r in mb}
    rows = []
    for start in range(0, len(ma), window):
        chunk = [r for r in ma[start:start + window] if int(r["step"]) in by_step_b]
        if not chunk:
            continue
        first, last = int(chunk[0]["step"]), int(chunk[-1]["step"])
        rows.append({
            "steps": [first, last],
            "train_lm_gap": statistics.fmean(
                r["lm_loss"] - by_step_b[int(r["step"])]["lm_loss"] for r in chunk),
            "val_gap": (ea[last] - eb[last]) if last in ea and last in eb else None,
            "lambda": statistics.fmean(float(r.get("lambda") or 0.0) for r in chunk),
            "penalty_share": statistics.fmean(
                (r["loss"] - r["lm_loss"]) / r["loss"] for r in chunk),
            "sparsity": statistics.fmean(float(r["sparsity"]) for r in chunk),
            "lr": float(chunk[0]["lr"]),
        })
    return {"run": a, "reference": b, "window": window, "steps": len(ma), "windows": rows}


def phases(result: dict, early: tuple[int, int], late: tuple[int, int]) -> dict:
    """The mean train gap, penalty share and lambda over the windows inside each phase."""
    out = {}
    for name, (lo, hi) in (("early", early), ("late", late)):
        rows = [r for r in result["windows"] if r["steps"][0] >= lo and r["steps"][1] <= hi]
        if not rows:
            raise SystemExit(f"error: --{name} {lo} {hi} holds no whole window of "
                             f"{result['window']} steps")
        out[name] = {"steps": [lo, hi], **{k: statistics.fmean(r[k] for r in rows)
                                           for k in ("train_lm_gap", "penalty_share", "lambda")}}
    out["gap_change"] = out["late"]["train_lm_gap"] - out["early"]["train_lm_gap"]
    out["penalty_share_change"] = out["late"]["penalty_share"] - out["early"]["penalty_share"]
    out["lambda_ratio"] = out["late"]["lambda"] / max(out["early"]["lambda"], 1e-30)
    return out


def _markdown(result: dict) -> str:
    lines = [f"### {result['run']} - {result['reference']}", "",
             "| steps | train LM gap | val gap (fixed sample) | lambda | penalty share | "
             "sparsity | lr |", "|---|---|---|---|---|---|---|"]
    for r in result["windows"]:
        val = "--" if r["val_gap"] is None else f"{r['val_gap']:+.3f}"
        lines.append(f"| {r['steps'][0]}-{r['steps'][1]} | {r['train_lm_gap']:+.3f} | {val} | "
                     f"{r['lambda']:.3g} | {r['penalty_share']:.4f} | {r['sparsity']:.3f} | "
                     f"{r['lr']:.2e} |")
    ph = result["phases"]
    e, l = ph["early"], ph["late"]
    lines += ["", f"Steps {e['steps'][0]}-{e['steps'][1]}: gap {e['train_lm_gap']:+.3f}, penalty "
              f"share {e['penalty_share']:.4f}; steps {l['steps'][0]}-{l['steps'][1]}: gap "
              f"{l['train_lm_gap']:+.3f}, penalty share {l['penalty_share']:.4f} (gap "
              f"{ph['gap_change']:+.3f}, share {ph['penalty_share_change']:+.4f}, lambda "
              f"x{ph['lambda_ratio']:.1f}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", type=Path, help="a study's results folder (holds runs/)")
    p.add_argument("--pairs", nargs="+", required=True, metavar="A:B",
                   help="run labels, compared as A minus B")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--window", type=int, default=200, help="steps per window (default 200)")
    p.add_argument("--early", nargs=2, type=int, default=[201, 1000], metavar=("FIRST", "LAST"),
                   help="the early phase's steps (default 201 1000: after stage I)")
    p.add_argument("--late", nargs=2, type=int, default=[2001, 2400], metavar=("FIRST", "LAST"),
                   help="the late phase's steps (default 2001 2400: the last 400)")
    p.add_argument("--out", type=Path, help="write the JSON here (and a .md beside it)")
    args = p.parse_args(argv)
    runs = args.study / "runs"
    if not runs.is_dir():
        p.error(f"study: {runs} is not a folder")
    if args.window < 1:
        p.error(f"--window={args.window} must be >= 1")
    results = []
    for pair in args.pairs:
        if pair.count(":") != 1:
            p.error(f"--pairs: {pair!r} must look like A:B")
        a, b = pair.split(":")
        for s in args.seeds:
            ra, rb = f"{a}-s{s}", f"{b}-s{s}"
            for name in (ra, rb):
                if not _metrics(runs / name):
                    p.error(f"--pairs: {runs / name} has no metrics")
            result = timeline(runs, ra, rb, args.window)
            result["phases"] = phases(result, tuple(args.early), tuple(args.late))
            results.append(result)
    text = "\n".join(_markdown(r) for r in results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"study": str(args.study), "results": results}, indent=1) + "\n")
        tmp.replace(args.out)
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
