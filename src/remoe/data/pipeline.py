"""``prepare_data``: corpus -> splits -> tokenizer -> token stores, cached with a manifest.

Cache layout (``DataConfig.cache_dir``)::

    manifest.json            format version, config, fingerprints, sizes, sha256 of every file
    corpus/{split}.jsonl     the split's documents (Pile format, meta.pile_set_name = domain)
    tokenizer.json           the tokenizer used for the token arrays
    tokens/{split}.*.npy     packed token arrays (see remoe.data.store)

Each stage has a key (a sha256 of everything it depends on) recorded in the manifest:

* corpus:    fingerprints of the collected documents (sha256 of their keys and texts per
  domain) + split fractions. The sources are read on every call (about a second for the
  built-in corpus) to compute these: a changed source is always noticed.
* tokenizer: the corpus key + vocabulary size (trained) or the loaded file's content.
* tokens:    the corpus key + the sha256 of ``tokenizer.json``.

A stage whose key matches and whose files match their recorded sizes and sha256 is reused as
is (no re-tokenisation); otherwise a warning says why and it is rebuilt. All files are written
to a temporary name and moved into place, and the manifest last, so an interrupted build is
never mistaken for a finished one. A file lock serialises concurrent builds (e.g. several ranks).
A cache another process is reading (a run training on it holds ``.readers/<pid>`` as long as its
data is in use) is never changed: a build that would rewrite a file refuses in one line.

Parts: :mod:`remoe.data.cachelock` (the lock), :mod:`remoe.data.manifest` (keys, structure
check, file verification), :mod:`remoe.data.build` (the three stages),
:mod:`remoe.data.bundle` (:class:`DataBundle`, the result).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from remoe.data._io import atomic_write_json
from remoe.data.build import (MIN_FREQUENCY, TOKENIZER_ALGO, Reporter, corpus_stage,
                              tokenizer_stage, tokens_stage)
from remoe.data.bundle import DataBundle, load_documents
from remoe.data.cachelock import (LOCK_FILE, NOT_WRITABLE, live_readers, locked,
                                  register_reader, release_reader)
from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.data.documents import SPLITS
from remoe.data.errors import DataError, DataNotFoundError
from remoe.data.shards import DEFAULT_SHARD_BYTES
from remoe.data.streambuild import STORE_DIR, build_store, finished_manifest, verify_store
from remoe.data.manifest import (FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, manifest_problem,
                                 read_manifest, verify_files)

__all__ = [  # the names this module has always offered (some now live in the modules above)
    "DataBundle", "FORMAT_VERSION", "LOCK_FILE", "MANIFEST", "MIN_FREQUENCY", "TOKENIZER_ALGO",
    "TOKENIZER_FILE", "load_documents", "load_prepared", "manifest_problem", "prepare_data",
    "tokens_fingerprint",
]

log = logging.getLogger("remoe.data")


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


def _prepare_locked(cfg: DataConfig, cache: Path, rep: Reporter, progress: bool) -> DataBundle:
    manifest, why = read_manifest(cache)
    if why is not None:
        log.warning("data cache %s: %s; treating the cache as corrupt and rebuilding it",
                    cache, why)
    elif manifest is None and (cache / "tokens").exists():
        log.warning("data cache %s has files but no manifest; rebuilding", cache)
    old = manifest or {}

    corpus_entry, splits, corpus = corpus_stage(cfg, cache, old.get("corpus"), rep)
    domains = corpus_entry["domains"]
    new: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "config": {"sources": list(cfg.sources), "max_bytes_per_domain":
                   cfg.max_bytes_per_domain, "val_fraction": cfg.val_fraction,
                   "test_fraction": cfg.test_fraction, "vocab_size": cfg.vocab_size,
                   "tokenizer": cfg.tokenizer,
                   "tokenizer_train_bytes": cfg.tokenizer_train_bytes},
        "domains": domains,
        "corpus": corpus_entry,
    }
    if old.get("corpus") != corpus_entry:
        # the old tokenizer/token entries describe another corpus: drop them before the
        # corpus files they do not match are recorded
        atomic_write_json(cache / MANIFEST, new)

    tok_entry, tok = tokenizer_stage(cfg, cache, corpus_entry["key"], splits["train"],
                                      old.get("tokenizer"), rep, progress)
    new["tokenizer"] = tok_entry
    tokens_entry = tokens_stage(cache, corpus_entry["key"], tok_entry, tok, splits, domains,
                                 old.get("tokens"), rep, progress)
    new["tokens"] = tokens_entry
    if new != manifest:
        atomic_write_json(cache / MANIFEST, new)
    rep.say("data ready")
    return _bundle(cache, new, tok, cfg.seed)


def _store_bundle(cache: Path, m: dict[str, Any], seed: int) -> DataBundle:
    root = cache / STORE_DIR / m["dir"]
    t = m["tokenizer"]
    return DataBundle(cache_dir=cache, tokenizer=Tokenizer.from_file(str(root / TOKENIZER_FILE)),
                      tokenizer_path=root / TOKENIZER_FILE, vocab_size=int(t["vocab_size"]),
                      eos_id=int(t["eos_id"]), eos_token=t["eos_token"],
                      domains=list(m["domains"]), manifest=m, seed=seed, store_root=root)


def _bundle(cache: Path, manifest: dict[str, Any], tok: Tokenizer, seed: int) -> DataBundle:
    t = manifest["tokenizer"]
    return DataBundle(cache_dir=cache, tokenizer=tok, tokenizer_path=cache / TOKENIZER_FILE,
                      vocab_size=int(t["vocab_size"]), eos_id=int(t["eos_id"]),
                      eos_token=t["eos_token"], domains=list(manifest["domains"]),
                      manifest=manifest, seed=seed)


def load_prepared(cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR, *, verify: bool = True,
                  seed: int = 0) -> DataBundle:
    """Open a cache built by :func:`prepare_data` without reading the sources.

    With ``verify`` (default) every file is checked against the sha256 in the manifest;
    without it only existence and sizes are. The process counts as a reader of the cache while
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


def _load_prepared_locked(cache: Path, verify: bool, seed: int) -> DataBundle:
    manifest, why = read_manifest(cache)
    if manifest is None or "tokens" not in manifest:
        raise DataNotFoundError(f"no complete data cache in {cache}"
                                f"{' (' + why + ')' if why else ''} (run `remoe data`)")
    tok_path = cache / TOKENIZER_FILE
    files = dict(manifest["corpus"]["files"])
    files[TOKENIZER_FILE] = {"sha256": manifest["tokenizer"]["sha256"],
                             "bytes": tok_path.stat().st_size if tok_path.is_file() else -1}
    for s in SPLITS:
        for what, meta in manifest["tokens"]["splits"][s]["files"].items():
            files[f"tokens/{s}.{what}.npy"] = meta
    if verify:
        problem = verify_files(cache, files)
    else:
        problem = None
        for rel, meta in sorted(files.items()):
            p = cache / rel
            if rel != TOKENIZER_FILE and (not p.is_file() or p.stat().st_size != meta["bytes"]):
                problem = f"{rel} is missing or truncated"
                break
    if problem is not None:
        raise ValueError(f"data cache {cache} is corrupt: {problem} (run `remoe data` to rebuild)")
    return _bundle(cache, manifest, Tokenizer.from_file(str(tok_path)), seed)


def tokens_fingerprint(arr: np.ndarray) -> str:
    """sha256 of an array's bytes (handy to compare stores in tests and tools)."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
