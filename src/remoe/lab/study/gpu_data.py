"""The GPU study's data: the built-in corpus, tokenised here, packed small enough to travel.

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

import json
import os
import subprocess
import tarfile
from pathlib import Path

from remoe.errors import ConfigError
from remoe.fileio import atomic_open
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
