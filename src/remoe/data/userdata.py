"""User corpora: directories or files of ``.txt`` and Pile-format ``.jsonl`` / ``.jsonl.zst``.

* ``.txt``: one document per file; its domain is the name given in the source spec
  (``NAME=PATH``) or else the file's parent directory name.
* ``.jsonl`` / ``.jsonl.zst`` / ``.jsonl.gz``: one document per line,
  ``{"text": ..., "meta": {"pile_set_name": ...}}``; a record without a set name gets the
  domain given in the spec or ``"unknown"``. A spec name overrides the set names.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from pathlib import Path
from typing import IO, Iterator

from remoe.data.documents import Document, decode_text, normalize_text

log = logging.getLogger("remoe.data")

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz")
TEXT_SUFFIXES = (".txt",)
UNKNOWN_DOMAIN = "unknown"


def is_data_file(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(JSONL_SUFFIXES + TEXT_SUFFIXES)


def _open_jsonl(path: Path) -> IO[str]:
    name = path.name.lower()
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:  # pragma: no cover - zstandard is a dependency
            raise RuntimeError(f"reading {path} needs the zstandard package "
                               "(pip install zstandard)") from e
        fh = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True,
                                                            closefd=True)
        return io.TextIOWrapper(io.BufferedReader(reader), encoding="utf-8", errors="replace",
                                newline="\n")
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace",
                                newline="\n")
    return open(path, encoding="utf-8", errors="replace", newline="\n")


def read_jsonl(path: str | os.PathLike[str], domain: str | None = None,
               key_prefix: str | None = None) -> Iterator[Document]:
    """Documents of a Pile-format JSONL file (optionally zstd/gzip compressed), in file order.

    Keys are ``<key_prefix or file name>:<line number>``. Malformed lines are skipped with a
    warning that names the file and line.
    """
    path = Path(path)
    prefix = key_prefix if key_prefix is not None else path.name
    bad = 0
    with _open_jsonl(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                text = rec["text"]
                if not isinstance(text, str):
                    raise TypeError("'text' is not a string")
            except (ValueError, KeyError, TypeError) as e:
                bad += 1
                if bad <= 5:
                    log.warning("%s:%d: skipping malformed record (%s)", path, lineno, e)
                continue
            meta = rec.get("meta") if isinstance(rec, dict) else None
            set_name = meta.get("pile_set_name") if isinstance(meta, dict) else None
            dom = domain or (str(set_name) if set_name else UNKNOWN_DOMAIN)
            yield Document(dom, f"{prefix}:{lineno}", normalize_text(text))
    if bad > 5:
        log.warning("%s: %d malformed records skipped in total", path, bad)


def read_text_file(path: Path, domain: str | None, key: str) -> Document:
    return Document(domain or path.parent.name or UNKNOWN_DOMAIN, key,
                    decode_text(path.read_bytes()))


def read_user_source(path: str | os.PathLike[str], domain: str | None = None) -> Iterator[Document]:
    """Documents under ``path`` (a file or a directory walked in sorted order).

    Keys are paths relative to the parent of ``path`` (so ``corpus/a/b.txt`` has key
    ``corpus/a/b.txt`` when ``corpus`` is given): stable wherever the directory is moved.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data source {str(root)!r} does not exist")
    base = root.resolve().parent
    if root.is_file():
        files = [root]
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                if not fn.startswith(".") and is_data_file(p):
                    files.append(p)
        if not files:
            log.warning("data source %s contains no .txt/.jsonl/.jsonl.zst files", root)
    for p in files:
        rel = p.resolve().relative_to(base).as_posix()
        if p.name.lower().endswith(JSONL_SUFFIXES):
            yield from read_jsonl(p, domain=domain, key_prefix=rel)
        elif p.name.lower().endswith(TEXT_SUFFIXES):
            yield read_text_file(p, domain, rel)
        else:
            raise ValueError(f"unsupported data file {p} (expected .txt, .jsonl, .jsonl.zst)")
