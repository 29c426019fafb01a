"""``prepare_data`` / ``load_prepared``: the data cache (``DataConfig.cache_dir``) and its
sharded store.

The store lives in ``<cache_dir>/store-v2/`` (layout and build: :mod:`remoe.data.streambuild`;
reading: :mod:`remoe.data.shardstore`). ``prepare_data`` builds it, or reuses a finished one
whose key matches the settings and the sources' fingerprint; ``load_prepared`` opens a finished
one without reading the sources. A file lock serialises concurrent builds (e.g. several ranks).
A cache another process is reading (a run training on it holds ``.readers/<pid>`` as long as its
data is in use) is never changed: a build that would rewrite a file refuses in one line.

Parts: :mod:`remoe.data.cachelock` (the lock and readers), :mod:`remoe.data.streambuild` (the
build), :mod:`remoe.data.bundle` (:class:`DataBundle`, the result).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from remoe.data.bundle import DataBundle, load_documents
from remoe.data.cachelock import (LOCK_FILE, NOT_WRITABLE, live_readers, locked,
                                  register_reader, release_reader)
from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.data.errors import DataError, DataNotFoundError
from remoe.data.shards import DEFAULT_SHARD_BYTES
from remoe.data.streambuild import (MIN_FREQUENCY, STORE_DIR, TOKENIZER_ALGO, TOKENIZER_FILE,
                                    build_store, finished_manifest, verify_store)

__all__ = [  # the names this module has always offered (some now live in the modules above)
    "DataBundle", "LOCK_FILE", "MIN_FREQUENCY", "TOKENIZER_ALGO", "TOKENIZER_FILE",
    "has_prepared", "load_documents", "load_prepared", "prepare_data", "tokens_fingerprint",
]

log = logging.getLogger("remoe.data")


class Reporter:
    """The build's progress lines: on stderr with progress on, else to the ``remoe.data`` log."""

    def __init__(self, enabled: bool, guard=None):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.guard = guard  # called with what is about to change before any cache file is written

    def before_write(self, what: str) -> None:
        if self.guard is not None:
            self.guard(what)

    def say(self, msg: str) -> None:
        line = f"[remoe.data {time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
        else:  # no progress display: the build's lines still reach a caller's logging handler
            log.info(line)


def _not_writable(cache: Path, e: OSError) -> DataError:
    where = f"{e.strerror or e}: {e.filename}" if e.filename else f"{e.strerror or e}"
    if e.errno == errno.ENOSPC:
        return DataError(f"disk full while writing the data cache {cache} ({where}); free "
                         "space or set data.cache_dir to another disk")
    return DataError(f"data cache {cache} must be (re)built but is not writable ({where}): "
                     "make it writable, run `remoe data` where it is, or set data.cache_dir "
                     "to a writable directory")


def prepare_data(cfg: DataConfig | None = None, *, progress: bool = True, workers: int = 1,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> DataBundle:
    """Build (or reuse from ``cfg.cache_dir``) the corpus, tokenizer and token stores.

    Raises :class:`DataError` (a one-line ``ConfigError``) when the input cannot give usable
    data: no documents, a corrupt or binary source file, an empty train or validation split,
    or a cache that needs building but is read-only (a complete one is read without writing).
    """
    cfg = (cfg or DataConfig()).validate()
    cache = Path(cfg.cache_dir)

    def refuse_if_read(what: str) -> None:  # before any file of the cache changes
        pids = live_readers(cache)
        if pids:
            raise DataError(f"data cache {cache} is in use by pid {', '.join(pids)} (a run "
                            f"training on it): rebuilding {what} would change it under that "
                            "run; set data.cache_dir to another directory for these data "
                            "settings, or wait for the run to finish")

    rep = Reporter(progress, guard=refuse_if_read)
    with locked(cache) as writable:
        try:
            m = build_store(cfg, cache, rep.say, progress, workers=workers,
                            shard_bytes=shard_bytes, before_write=rep.before_write)
            bundle = _store_bundle(cache, m, cfg.seed)
            # this process reads the cache as long as the bundle lives: nobody rebuilds it
            fd = register_reader(cache) if writable else None
            if fd is not None:
                weakref.finalize(bundle, release_reader, fd)
            return bundle
        except OSError as e:
            if isinstance(e, DataError) or e.errno not in NOT_WRITABLE + (errno.ENOSPC,):
                raise
            in_cache = e.filename is None or Path(os.path.abspath(e.filename)).is_relative_to(
                Path(os.path.abspath(cache)))
            if not in_cache and e.errno != errno.ENOSPC:
                raise  # e.g. an unreadable source file: not the cache's fault
            raise _not_writable(cache, e) from None


def _store_bundle(cache: Path, m: dict[str, Any], seed: int) -> DataBundle:
    root = cache / STORE_DIR / m["dir"]
    t = m["tokenizer"]
    return DataBundle(cache_dir=cache, tokenizer=Tokenizer.from_file(str(root / TOKENIZER_FILE)),
                      tokenizer_path=root / TOKENIZER_FILE, vocab_size=int(t["vocab_size"]),
                      eos_id=int(t["eos_id"]), eos_token=t["eos_token"],
                      domains=list(m["domains"]), manifest=m, seed=seed, store_root=root)


def has_prepared(cache_dir: str | os.PathLike[str]) -> bool:
    """Whether ``cache_dir`` holds a finished store (its manifest; no file is hashed)."""
    return finished_manifest(Path(cache_dir) / STORE_DIR, None) is not None


def load_prepared(cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR, *, verify: bool = True,
                  seed: int = 0) -> DataBundle:
    """Open a cache built by :func:`prepare_data` without reading the sources.

    With ``verify`` (default) every file of the store is checked against the sha256 in its
    manifest now; without it each file is checked the first time it is read
    (:class:`remoe.data.shardstore.ShardedStore`). The process counts as a reader of the cache while
    the bundle lives (:mod:`remoe.data.cachelock`): a build with other settings is refused.
    Raises FileNotFoundError (also a DataError) if the cache is incomplete or its manifest
    malformed, ValueError if a file is corrupt (run ``prepare_data`` / ``remoe data`` to
    rebuild it).
    """
    cache = Path(cache_dir)
    if not cache.is_dir():
        raise DataNotFoundError(f"no complete data cache in {cache} (run `remoe data`)")
    # under the cache's lock (not while a build is half done), and registered as a reader as
    # long as the bundle lives: `remoe eval` / analyses reading it are not rebuilt under
    with locked(cache) as writable:
        m = finished_manifest(cache / STORE_DIR, None)
        if m is None:
            raise DataNotFoundError(f"no complete data cache in {cache} (run `remoe data`)")
        if verify:
            problems = verify_store(cache)
            if problems:
                raise ValueError(f"data cache {cache} is corrupt: {problems[0]} (run `remoe "
                                 "data` to rebuild)")
        bundle = _store_bundle(cache, m, seed)
        fd = register_reader(cache) if writable else None
        if fd is not None:
            weakref.finalize(bundle, release_reader, fd)
        return bundle


def tokens_fingerprint(arr: np.ndarray) -> str:
    """sha256 of an array's bytes (handy to compare stores in tests and tools)."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
