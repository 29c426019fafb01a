"""What the store was built from: the sources' canonical spelling, their files' content, and
the token ids of pre-tokenised (Megatron) sources, recorded when a build begins.

* :func:`canonical_sources` spells every path source absolutely (``NAME=/abs/path?opts``), so
  ``my.jsonl`` and ``/home/me/my.jsonl`` are one source: one build key, one store.
* :func:`record_sources` reads every file of the user sources once (sha256, size, modification
  time) and, for a Megatron ``.bin``, the smallest and largest token id in the same pass. A
  build writes it to ``<key16>/sources.json`` before the plan pass and the manifest keeps it
  (``sources``); the built-in corpus is identified by its candidate list (the build key), not
  hashed.
* :func:`source_changes` compares a record with the files now: a resumed build does it before it
  trusts anything of the interrupted one, ``remoe data --verify`` for a finished store. A
  change means everything derived from the sources (plan, tokenizer, units, index, held-out
  copies) is discarded and built again, never mixed.
* :func:`check_token_ids` refuses, in one line naming the source, its largest id and the
  vocabulary, a pre-tokenised source without a tokenizer or with ids the tokenizer cannot
  have produced -- before any other work.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from remoe.data._io import file_change
from remoe.data.errors import DataError

_READ_BYTES = 1 << 24  # 16 MiB per read when hashing


def canonical_source(spec: str) -> str:
    """``spec`` with its path made absolute (``builtin`` specs unchanged)."""
    from remoe.data.corpus import parse_source

    s = parse_source(spec)
    if s.kind != "path" or s.path is None:
        return s.describe()
    out = os.path.abspath(os.path.expanduser(s.path))
    if s.domain:
        out = f"{s.domain}={out}"
    if s.options:
        out += "?" + "&".join(f"{k}={v}" for k, v in s.options)
    return out


def canonical_sources(sources: list[str]) -> list[str]:
    return [canonical_source(s) for s in sources]


def source_files(spec: str) -> list[Path]:
    """The files of one path source (a Megatron prefix: its ``.bin`` and ``.idx``), sorted;
    ``[]`` for a built-in spec."""
    from remoe.data.corpus import parse_source
    from remoe.data.megatron import megatron_prefix

    s = parse_source(spec)
    if s.kind != "path" or s.path is None:
        return []
    prefix = megatron_prefix(s.path)
    if prefix is not None:
        return [Path(f"{prefix}.bin"), Path(f"{prefix}.idx")]
    root = Path(s.path)
    if not root.is_dir():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _read_file(path: Path, dtype: np.dtype | None) -> dict[str, Any]:
    """sha256 of ``path`` and, with ``dtype``, the range of the ids it holds (one read)."""
    h = hashlib.sha256()
    lo = hi = None
    tail = b""
    st = path.stat()
    with open(path, "rb") as f:
        while buf := f.read(_READ_BYTES):
            h.update(buf)
            if dtype is None:
                continue
            buf = tail + buf
            cut = len(buf) - len(buf) % dtype.itemsize
            tail = buf[cut:]
            ids = np.frombuffer(buf[:cut], dtype=dtype)
            if ids.size:
                lo = int(ids.min()) if lo is None else min(lo, int(ids.min()))
                hi = int(ids.max()) if hi is None else max(hi, int(ids.max()))
    out: dict[str, Any] = {"path": str(path.resolve()), "bytes": st.st_size,
                           "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
    if dtype is not None:
        out.update(dtype=dtype.name, min_id=lo, max_id=hi)
    return out


def record_sources(sources: list[str]) -> list[dict[str, Any]]:
    """One entry per file of the path sources: ``source`` (its spec), ``path``, ``bytes``,
    ``mtime_ns``, ``sha256``; a Megatron ``.bin`` also ``dtype``, ``min_id``, ``max_id``
    (None for an empty one)."""
    from remoe.data.corpus import parse_source
    from remoe.data.megatron import MegatronDataset, is_megatron_spec, megatron_prefix

    out = []
    for spec in sources:
        parsed = parse_source(spec)
        prefix = megatron_prefix(str(parsed.path)) if is_megatron_spec(parsed) else None
        for path in source_files(spec):
            dtype = (MegatronDataset(prefix).dtype if prefix is not None and path.suffix == ".bin"
                     else None)
            out.append({"source": spec, **_read_file(path, dtype)})
    return out


def source_changes(record: list[dict[str, Any]], sources: list[str], *, full: bool = True
                   ) -> list[str]:
    """Why the sources are no longer what ``record`` was taken from (files changed, removed
    or added); ``[]`` when they are the same."""
    problems = [p for e in record if (p := file_change(e, full=full)) is not None]
    known = {e["path"] for e in record}
    for spec in sources:
        for path in source_files(spec):
            if str(path.resolve()) not in known:
                problems.append(f"source file {path} is new since the store was built")
    return problems


def check_token_ids(record: list[dict[str, Any]], tokenizer: str | None, vocab: int) -> None:
    """Refuse (one line naming the source, its largest id and the vocabulary) a pre-tokenised
    source without a tokenizer (``vocab``: what would be trained), or whose ids fall outside
    ``[0, vocab)`` of the tokenizer ``tokenizer``."""
    for e in record:
        if "dtype" not in e or e["max_id"] is None:
            continue
        where = (f"data source {e['source']!r} ({Path(e['path']).name}: largest token id "
                 f"{e['max_id']:,})")
        if tokenizer is None:
            raise DataError(f"{where} is already tokenised: give the tokenizer that made it "
                            f"(data.tokenizer / --tokenizer); a BPE of {vocab:,} ids trained "
                            "here would give its ids other meanings")
        if e["max_id"] >= vocab or e["min_id"] < 0:
            why = (f"{e['max_id']:,} does not fit" if e["max_id"] >= vocab else
                   f"it holds a negative id ({e['min_id']:,}), which does not fit")
            raise DataError(f"{where}: {why} the tokenizer {tokenizer} (vocabulary {vocab:,}, "
                            f"ids 0..{vocab - 1:,}): give the tokenizer that made the dataset")
