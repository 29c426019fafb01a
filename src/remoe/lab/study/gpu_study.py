"""``scripts/gpu_study.sh``: TopK vs ReMoE at the paper's ``small`` size in one GPU command.

Trains the ``small`` preset (182M dense backbone, E=8, k=1, sequence 1024) on the built-in
corpus (the CPU studies' store, BPE 8,192: :mod:`remoe.lab.study.gpu_data`) with the real
:class:`remoe.train.trainer.Trainer`, one run after the other (:mod:`remoe.lab.study.gpu_runs`;
the runs and the plan: :mod:`remoe.lab.study.gpu_plan`): TopK, ReMoE with the recommended
control, then, if time allows, ReMoE with the paper's controller. Every run trains the same
number of steps, so the same tokens; that number is sized from the throughput the first run
measures in its first ``--probe-steps`` steps, so that the runs the budget is sized for
(``--size-for``, default all) fit ``--budget-s``. The schedule's horizon is set then, inside the
warm-up, so every step's learning rate is the one a run configured with that horizon from the
start would take.

The loop is the trainer's own step (``Trainer.train_step``) and validation (``evaluate``: the
fixed sample, ``train.eval_chunks_per_domain`` sequences per domain), driven here instead of
``Trainer.train`` because that one ends with a full checkpoint and ``final/`` (gigabytes of
weights and optimizer state at this size, minutes of the device's clock). Evaluations run at
the same steps in every run, under the run's autocast; after the last step each run is also
evaluated on the whole validation split. After every evaluation the study so far is written
to ``$OUT`` (:mod:`remoe.lab.study.gpu_record`), and after every run the table and figure
(:mod:`remoe.lab.study.gpu_report`). ``--deadline-s`` is a hard stop: the run in progress is
cut there (it keeps what it measured) and later runs are skipped.

Without CUDA the same path runs on CPU with a tiny model, a few steps per run, and exits 0.
``--build-data`` builds and packs the data here; ``--results-only DIR`` rebuilds the table and
figure from the JSON files of a finished study (docs/SCALING.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from remoe.errors import ConfigError
from remoe.lab.study import gpu_data, gpu_report, gpu_record
from remoe.lab.study.gpu_plan import DEFAULTS, RELU_SPEED, RUNS, resolve
from remoe.lab.study.gpu_runs import Study


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu_study.sh", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON, log, table and figure go (default: $OUT, else "
                        "bench_results/gpu_study)")
    p.add_argument("--data", type=Path, default=gpu_data.DEFAULT_PACK,
                   help=f"the packed store (default {gpu_data.DEFAULT_PACK}) or a data cache")
    p.add_argument("--build-data", action="store_true",
                   help=f"build the store ({gpu_data.DEFAULT_CACHE}) and pack it to --data, "
                        "then exit")
    p.add_argument("--results-only", type=Path, default=None, metavar="DIR",
                   help="rebuild gpu_study.md / .png from DIR's JSON files (into --out-dir, "
                        "default DIR), then exit")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="the runs' directories and the unpacked data (default: a temporary "
                        "directory, removed at the end)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the study's planned wall time from its start (default 500 on CUDA, "
                        "20 on CPU)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="hard stop: the run in progress is cut (default budget + 25)")
    p.add_argument("--runs", default=",".join(r.name for r in RUNS),
                   help="which runs, in this order (default all)")
    p.add_argument("--size-for", type=int, default=None,
                   help="size the token budget so the first N runs fit (default: all); later "
                        "runs start only when their predicted time fits the budget")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run instead of sizing them from the probe")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap on the sized steps per run (default: none on CUDA, 6 on CPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="train.compile (CUDA only; default on: the faster setting measured "
                        "on an H200)")
    for name, typ, what in (("preset", str, "model preset"), ("seq-len", int, "sequence length"),
                            ("micro-batch", int, "sequences per step"),
                            ("warmup-steps", int, "LR warm-up steps"),
                            ("probe-steps", int, "steps timed before sizing"),
                            ("evals", int, "evaluations on the fixed sample per run"),
                            ("eval-chunks", int, "fixed sample: sequences per domain"),
                            ("eval-batch", int, "evaluation batch"),
                            ("whole-eval-chunks", int, "cap of the final evaluation per domain "
                                                       "(default: the whole split on CUDA)")):
        p.add_argument(f"--{name}", type=typ, default=None, help=f"{what} (CUDA / CPU defaults: "
                       f"{DEFAULTS[name.replace('-', '_')][0]} / "
                       f"{DEFAULTS[name.replace('-', '_')][1]})")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step (default 1)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak LR (default 5e-4, the paper's)")
    p.add_argument("--min-lr", type=float, default=5e-5, help="final LR (default 5e-5)")
    p.add_argument("--relu-speed", type=float, default=RELU_SPEED,
                   help=f"ReLU/TopK speed assumed when sizing (default {RELU_SPEED})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an experiment override for every run (repeatable)")
    return p


def _build_data() -> int:
    meta = gpu_data.build_pack(progress=True)
    tree = gpu_data.tree_bytes(Path.cwd())
    print(f"packed {gpu_data.DEFAULT_PACK}/{meta['archive']}: {meta['bytes'] / 1e6:.1f} MB "
          f"(store {meta['store_bytes'] / 1e6:.1f} MB, {meta['tokens']['train']:,} train tokens, "
          f"BPE {meta['vocab_size']})")
    if tree is not None:
        total = tree + meta["bytes"]
        print(f"a device command carries the working tree ({tree / 2**20:.1f} MiB) + this "
              f"({meta['bytes'] / 2**20:.1f} MiB) = {total / 2**20:.1f} MiB of "
              f"{gpu_data.TREE_LIMIT / 2**20:.0f} MiB"
              + ("" if total <= gpu_data.TREE_LIMIT else ": TOO LARGE"))
        if total > gpu_data.TREE_LIMIT:
            return 1
    print(f"carry: {gpu_data.DEFAULT_PACK}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.build_data:
            return _build_data()
        if args.results_only is not None:
            for path in gpu_report.write(args.results_only, args.out_dir):
                print(f"wrote {path}")
            return 0
        return _study(args)
    except ConfigError as e:
        print(f"gpu study: {e}", file=sys.stderr)
        return 2


def _study(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()  # the study's clock includes the imports
    import torch

    from remoe.experiment import padded_vocab
    from remoe.lab.bench.gpu import device_info
    from remoe.lab.bench.gpu_check import versions

    cuda = torch.cuda.is_available()
    s = resolve(args, cuda)
    out = gpu_record.Output(args.out_dir
                            or Path(os.environ.get("OUT") or "bench_results/gpu_study"))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="remoe-gpu-study-"))
    try:
        if not cuda:
            out.log("no CUDA device: the same path on CPU with a micro model and a few steps")
        bundle = gpu_data.open_data(args.data, work / "data")
        dev = torch.device(s.device)
        info = device_info(dev)
        env = {"device": info, "versions": versions()}
        data_info = {"path": str(args.data), "store": bundle.manifest["dir"],
                     "tokenizer": "byte-level BPE trained on the built-in corpus",
                     "tokenizer_vocab": bundle.vocab_size,
                     "model_vocab": padded_vocab(bundle.vocab_size),
                     "domains": list(bundle.domains),
                     "tokens": {sp: int(bundle.split(sp).num_tokens)
                                for sp in ("train", "validation", "test")},
                     "settings": gpu_data.STUDY_DATA}
        out.log(f"[env] {info['name']}; torch {env['versions']['torch']}; data {args.data}: "
                f"BPE {bundle.vocab_size} (model vocabulary {data_info['model_vocab']}), "
                f"{data_info['tokens']['train']:,} train tokens")
        study = Study(s, bundle, out, work, data_info, env, t0)
        study.run_all()
        out.log(f"done in {study.now():.0f} s: {out.dir}")
        return 0
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
