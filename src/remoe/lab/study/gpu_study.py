"""``scripts/gpu_study.sh``: TopK vs ReMoE at the paper's ``small`` size in one GPU command.

Trains the ``small`` preset (182M dense backbone, E=8, k=1, sequence 1024) on the built-in
corpus (the CPU studies' store, BPE 8,192: the data below) with the real
:class:`remoe.train.trainer.Trainer`, one run after the other (the runs and the plan:
:mod:`remoe.lab.study.gpu_runs`): TopK, ReMoE with the recommended control, then, if time
allows, ReMoE with the paper's controller. Every run trains the same number of steps, so the
same tokens; that number is sized from the throughput the first run measures in its first
``--probe-steps`` steps, so that the runs the budget is sized for (``--size-for``, default all)
fit ``--budget-s``. The schedule's horizon is set then, inside the warm-up, so every step's
learning rate is the one a run configured with that horizon from the start would take.

The loop is the trainer's own step (``Trainer.train_step``) and validation (``evaluate``: the
fixed sample, ``train.eval_chunks_per_domain`` sequences per domain), driven here instead of
``Trainer.train`` because that one ends with a full checkpoint and ``final/`` (gigabytes of
weights and optimizer state at this size, minutes of the device's clock). Evaluations run at
the same steps in every run, under the run's autocast; after the last step each run is also
evaluated on the whole validation split. After every evaluation the study so far is written
to ``$OUT``, and after every run the table and figure (:mod:`remoe.lab.study.gpu_report`).
``--deadline-s`` is a hard stop: the run in progress is cut there (it keeps what it measured)
and later runs are skipped.

Without CUDA the same path runs on CPU with a tiny model, a few steps per run, and exits 0.
``--build-data`` builds and packs the data here; ``--results-only DIR`` rebuilds the table and
figure from the JSON files of a finished study (docs/SCALING.md).

The data: the built-in corpus, tokenised here, packed small enough to travel.

A lent GPU machine has no internet, no corpus packages and no ``zstandard``, and what travels
with a command is the working tree (tracked files + carried git-ignored paths) up to 64 MiB in
all. So the token store is built here, with the CPU studies' data settings
(:data:`STUDY_DATA`: ``configs/study/backbone.yaml``'s data section, the built-in corpus and
its 8,192-token byte-level BPE), and packed as the store's own files in one deterministic
``store.tar.xz`` (``lzma`` is in the standard library; the uint16 token shard compresses
about 3x) beside a ``pack.json`` that names the archive's size and sha256:

* :func:`build_pack`: ``prepare_data`` into ``cache_dir`` (reused when already built), then
  :func:`pack_store` into ``pack_dir`` (git-ignored: ``.remoe_cache/``, carried by the
  device's ``run``);
* :func:`open_data`: on the machine that trains, a pack directory is checked against its
  ``pack.json`` and unpacked into a scratch directory, and the store is opened with
  :func:`remoe.data.load_prepared` (every file's sha256 checked against the store's own
  manifest); a cache directory (``store-v2/`` inside) is opened as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from remoe.errors import ConfigError
from remoe.fileio import atomic_open
from remoe.lab.study import gpu_report
from remoe.lab.study.gpu_runs import DEFAULTS, RELU_SPEED, RUNS, Study, resolve
from remoe.model.bundle import file_sha256

#: the data section the CPU studies train on (configs/study/backbone.yaml): built-in corpus,
#: BPE 8192, 12 MB per domain, 3% validation / 3% test
STUDY_DATA = {"sources": ["builtin"], "vocab_size": 8192, "max_bytes_per_domain": 12_000_000,
              "val_fraction": 0.03, "test_fraction": 0.03}
DEFAULT_CACHE = Path(".remoe_cache/gpu_study")
DEFAULT_PACK = Path(".remoe_cache/gpu_study_pack")
ARCHIVE, PACK_JSON = "store.tar.xz", "pack.json"
STORE_DIR = "store-v2"
MAX_PACK_BYTES = 60_000_000  # issue 47's bound for the carried data
TREE_LIMIT = 64 * 2**20  # what a device command carries: working tree + carried paths


def build_cache(cache_dir: Path, workers: int = 1, progress: bool = True):
    """The study's token store in ``cache_dir`` (built, or reused when it is already there)."""
    from remoe.data import DataConfig, prepare_data

    cfg = DataConfig(cache_dir=str(cache_dir), **STUDY_DATA)
    return prepare_data(cfg, progress=progress, workers=workers)


def pack_store(cache_dir: Path, pack_dir: Path, preset: int = 6) -> dict:
    """``<cache_dir>/store-v2`` as ``pack_dir/store.tar.xz`` (sorted members, zero times and
    owners: the same store gives the same bytes) and ``pack_dir/pack.json``."""
    from remoe.data import load_prepared

    bundle = load_prepared(cache_dir)  # a finished, intact store only
    store = Path(cache_dir) / STORE_DIR
    pack_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in store.rglob("*") if p.is_file())
    with atomic_open(pack_dir / ARCHIVE, "wb") as out, \
            tarfile.open(fileobj=out, mode="w:xz", preset=preset) as tar:
        for p in files:
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(cache_dir)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(p, "rb") as f:
                tar.addfile(info, f)
    meta = {"schema": "remoe-gpu-study-data/1", "archive": ARCHIVE,
            "bytes": (pack_dir / ARCHIVE).stat().st_size, "sha256": file_sha256(pack_dir / ARCHIVE),
            "store_bytes": sum(p.stat().st_size for p in files), "data": STUDY_DATA,
            "store": bundle.manifest["dir"], "vocab_size": bundle.vocab_size,
            "domains": list(bundle.domains),
            "tokens": {s: int(bundle.split(s).num_tokens)
                       for s in ("train", "validation", "test")}}
    (pack_dir / PACK_JSON).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def build_pack(cache_dir: Path = DEFAULT_CACHE, pack_dir: Path = DEFAULT_PACK, workers: int = 1,
               progress: bool = True) -> dict:
    """Build (or reuse) the store, pack it, and refuse a pack over :data:`MAX_PACK_BYTES`."""
    build_cache(cache_dir, workers=workers, progress=progress)
    meta = pack_store(cache_dir, pack_dir)
    if meta["bytes"] > MAX_PACK_BYTES:
        raise ConfigError(f"the packed store is {meta['bytes'] / 1e6:.1f} MB, over the "
                          f"{MAX_PACK_BYTES / 1e6:.0f} MB a device command may carry for it")
    return meta


def tree_bytes(root: Path) -> int | None:
    """Bytes of what a device command sends besides carried paths: tracked files and
    untracked files git does not ignore (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=root, capture_output=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for name in set(out.decode("utf-8", "surrogateescape").split("\0")) - {""}:
        p = root / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def open_data(path: Path, scratch: Path):
    """The study's :class:`remoe.data.DataBundle` from a pack directory (unpacked into
    ``scratch``) or a cache directory. One-line :class:`ConfigError` when neither is there."""
    from remoe.data import load_prepared

    path = Path(path)
    if (path / STORE_DIR).is_dir():
        return load_prepared(path)
    meta_path = path / PACK_JSON
    if not meta_path.is_file():
        raise ConfigError(f"--data {path}: no {PACK_JSON} (a pack) nor {STORE_DIR}/ (a data "
                          "cache) there; build it with `scripts/gpu_study.sh --build-data`")
    meta = json.loads(meta_path.read_text())
    archive = path / meta["archive"]
    if not archive.is_file() or file_sha256(archive) != meta["sha256"]:
        raise ConfigError(f"--data {path}: {meta['archive']} is missing or does not match "
                          f"{PACK_JSON}'s sha256; rebuild it with `scripts/gpu_study.sh "
                          "--build-data`")
    dest = Path(scratch) / f"data-{meta['sha256'][:16]}"
    if not (dest / STORE_DIR).is_dir():
        tmp = Path(scratch) / f".unpack-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, dest)
    return load_prepared(dest)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu_study.sh", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON, log, table and figure go (default: $OUT, else "
                        "bench_results/gpu_study)")
    p.add_argument("--data", type=Path, default=DEFAULT_PACK,
                   help=f"the packed store (default {DEFAULT_PACK}) or a data cache")
    p.add_argument("--build-data", action="store_true",
                   help=f"build the store ({DEFAULT_CACHE}) and pack it to --data, "
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
    meta = build_pack(progress=True)
    tree = tree_bytes(Path.cwd())
    print(f"packed {DEFAULT_PACK}/{meta['archive']}: {meta['bytes'] / 1e6:.1f} MB "
          f"(store {meta['store_bytes'] / 1e6:.1f} MB, {meta['tokens']['train']:,} train tokens, "
          f"BPE {meta['vocab_size']})")
    if tree is not None:
        total = tree + meta["bytes"]
        print(f"a device command carries the working tree ({tree / 2**20:.1f} MiB) + this "
              f"({meta['bytes'] / 2**20:.1f} MiB) = {total / 2**20:.1f} MiB of "
              f"{TREE_LIMIT / 2**20:.0f} MiB"
              + ("" if total <= TREE_LIMIT else ": TOO LARGE"))
        if total > TREE_LIMIT:
            return 1
    print(f"carry: {DEFAULT_PACK}")
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
    out = gpu_report.Output(args.out_dir
                            or Path(os.environ.get("OUT") or "bench_results/gpu_study"))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="remoe-gpu-study-"))
    try:
        if not cuda:
            out.log("no CUDA device: the same path on CPU with a micro model and a few steps")
        bundle = open_data(args.data, work / "data")
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
                     "settings": STUDY_DATA}
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
