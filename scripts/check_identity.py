#!/usr/bin/env python3
"""Check that a training config gives bit-identical results at two commits (developer tool).

    python scripts/check_identity.py BASE_COMMIT [--config configs/tiny_remoe.yaml]
                                     [--steps 40] [--set key=value ...]

Trains the config for ``--steps`` steps at one thread with the code of BASE_COMMIT (a temporary
git worktree) and with the working tree, both on this checkout's data cache, then compares every
metrics.jsonl number except the machine's (tokens/s, elapsed time, threads), eval.jsonl and the
final weights: the keys both sides have (keys only one side has are listed, not compared).
Prints the first difference and exits 1 if any; 0 if identical. The paper's
behaviour is the default and must stay bit for bit what it is: run this before merging a change
that touches the model, the routers, the losses or the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MACHINE_KEYS = ("tokens_per_s", "elapsed_s", "threads")  # as remoe.train.metrics.MACHINE_KEYS


def train(src: Path, out: Path, args: argparse.Namespace) -> Path:
    cache = (ROOT / ".remoe_cache" / "data").resolve()
    sets = [f"run.out_dir={out}", "run.name=r", f"train.max_steps={args.steps}",
            "train.num_threads=1", f"train.eval_every={max(1, args.steps // 2)}",
            f"train.save_every={args.steps}", f"data.cache_dir={cache}", *args.set]
    cmd = [sys.executable, "-m", "remoe.cli", "train", args.config, "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"training with {src} failed:\n{done.stderr[-2000:]}")
    return out / "r"


def jsonl(path: Path, drop=()) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in path.read_text().splitlines() if line.strip()]


def one_sided_keys(ra: list[dict], rb: list[dict]) -> tuple[list[str], list[str]]:
    """Keys of any line only at the base commit, and only in the working tree."""
    ka = set().union(*ra) if ra else set()
    kb = set().union(*rb) if rb else set()
    return sorted(ka - kb), sorted(kb - ka)


def compare_lines(name: str, ra: list[dict], rb: list[dict]) -> list[str]:
    """The first differing value of a key both lines have (a key only one side has is not a
    difference: :func:`one_sided_keys` lists them)."""
    if len(ra) != len(rb):
        return [f"{name}: {len(ra)} vs {len(rb)} lines"]
    for x, y in zip(ra, rb):
        for key in sorted(set(x) & set(y)):
            if x[key] != y[key]:
                return [f"{name} step {x.get('step')}: {key} {x[key]!r} != {y[key]!r}"]
    return []


def compare(a: Path, b: Path) -> list[str]:
    from safetensors.torch import load_file
    import torch

    problems = []
    for name, drop in (("metrics.jsonl", MACHINE_KEYS), ("eval.jsonl", ())):
        ra, rb = jsonl(a / name, drop), jsonl(b / name, drop)
        problems += compare_lines(name, ra, rb)
        only_a, only_b = one_sided_keys(ra, rb)
        if only_a:
            print(f"  {name}: keys only at the base commit (not compared): {', '.join(only_a)}")
        if only_b:
            print(f"  {name}: keys only in the working tree (not compared): {', '.join(only_b)}")
        if problems:
            break
    wa = load_file(str(a / "final" / "model.safetensors"))
    wb = load_file(str(b / "final" / "model.safetensors"))
    if wa.keys() != wb.keys():
        problems.append(f"weights: different tensor names {sorted(set(wa) ^ set(wb))[:5]}")
    else:
        diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
        if diff:
            problems.append(f"weights: {len(diff)} tensors differ, first {diff[0]}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the commit to compare against (e.g. origin/main, HEAD~3)")
    ap.add_argument("--config", default="configs/tiny_remoe.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], help="key=value for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="remoe-identity-") as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        # worktrees of earlier checks that were killed before their cleanup: forget them
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base],
                       cwd=ROOT, check=True)
        try:
            print(f"training {args.config} for {args.steps} steps at {args.base} ...")
            a = train(base / "src", tmp / "a", args)
            print("training it with the working tree ...")
            b = train(ROOT / "src", tmp / "b", args)
            problems = compare(a, b)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    if problems:
        print("DIFFERENT:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print(f"identical: metrics (all but {', '.join(MACHINE_KEYS)}), eval and final weights")


if __name__ == "__main__":
    main()
