"""User corpora: directories or files of ``.txt``, Pile-format ``.jsonl`` / ``.jsonl.zst`` and
Parquet.

* ``.txt``: one document per file; its domain is the name given in the source spec
  (``NAME=PATH``) or else the file's parent directory name.
* ``.jsonl`` / ``.jsonl.zst`` / ``.jsonl.gz``: one document per line,
  ``{"text": ..., "meta": {"pile_set_name": ...}}``: a record's set name is its domain (so
  ``pile=train.jsonl.zst`` keeps the Pile's domains); a record without one gets the name given
  in the spec, else ``"unknown"``.
* ``.parquet`` (what Hugging Face ``datasets`` stores, streamed with ``pyarrow`` in record
  batches, so memory does not grow with the file): one document per row; the text column is
  ``text`` unless the spec names another (``PATH?text=content``); the domain is the spec's
  ``NAME=``, else the value of a column the spec names (``?domain=source``), else
  ``unknown``. Keys are ``<file key>:<row>``.

Bad input is never used silently: a binary ``.txt`` or a truncated/corrupt compressed file is
a :class:`~remoe.data.errors.DataError` naming the file; skipped records, invalid UTF-8 and
Latin-1 fallbacks are warnings with counts.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from pathlib import Path
from typing import IO, Callable, Iterator

from remoe.data.documents import Document, decode_text, normalize_text
from remoe.data.errors import DataError, DataNotFoundError

log = logging.getLogger("remoe.data")

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
#: Hugging Face ``datasets`` ``save_to_disk`` writes Arrow files, which are not read
ARROW_HINT = ("Hugging Face datasets' save_to_disk .arrow files are not read: write Parquet "
              "with dataset.to_parquet('data.parquet') and give that")
TEXT_SUFFIXES = (".txt",)
UNKNOWN_DOMAIN = "unknown"

#: how the readers warn: ``log.warning`` when the sources are first read (the plan pass); the
#: passes that read them again pass a quieter one, so each warning is printed once per build
Warn = Callable[..., None]


def is_data_file(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(JSONL_SUFFIXES + TEXT_SUFFIXES + PARQUET_SUFFIXES)


_READ_CHUNK = 1 << 16  # also the granularity of "how far it got" in errors
#: control bytes that never occur in text (C0 minus tab, newlines, form feed, escape; DEL)
_C0 = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_C1 = bytes(range(0x80, 0xA0))
#: a .txt file with more control bytes than this share is binary (text has about none; random or
#: compressed bytes ~10 %, UTF-16 ~50 % NULs); below it, NULs are dropped with a warning
MAX_CONTROL_FRACTION = 0.01


def _zst_chunks(fh: IO[bytes]) -> Iterator[bytes]:
    """Decompressed bytes of a (multi-frame) zstd stream; raises DataError-ready errors.

    Unlike ``stream_reader``, a stream that ends inside a frame raises instead of ending early.
    """
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - zstandard is a dependency
        raise DataError(f"reading {fh.name} needs the zstandard package "
                        "(pip install zstandard)") from e
    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    in_frame = False  # bytes of the current frame were fed but its end was not seen yet
    while True:
        buf = fh.read(_READ_CHUNK)
        if not buf:
            break
        while buf:
            out = dobj.decompress(buf)
            in_frame = True
            if out:
                yield out
            if dobj.eof:  # frame complete: the rest of buf starts the next one
                buf = dobj.unused_data
                dobj = dctx.decompressobj()
                in_frame = False
            else:
                buf = b""
    if in_frame:
        raise EOFError("the stream ends inside a zstd frame (truncated file)")


def _gz_chunks(fh: IO[bytes]) -> Iterator[bytes]:
    with gzip.GzipFile(fileobj=fh, mode="rb") as g:
        while True:
            buf = g.read(_READ_CHUNK)
            if not buf:
                return
            yield buf


def _plain_chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while True:
        buf = fh.read(_READ_CHUNK)
        if not buf:
            return
        yield buf


def _stream_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errs.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errs)


def read_jsonl(path: str | os.PathLike[str], domain: str | None = None,
               key_prefix: str | None = None, warn: Warn = log.warning) -> Iterator[Document]:
    """Documents of a Pile-format JSONL file (optionally zstd/gzip compressed), in file order.

    Keys are ``<key_prefix or file name>:<line number>``. Malformed lines are skipped with a
    warning that names the file and line, and a count at the end; lines that are not valid
    UTF-8 are decoded with U+FFFD replacements, also counted in a warning. A compressed file
    that is truncated or corrupt raises :class:`DataError` naming the file and how far it got
    (never silently used in part).
    """
    path = Path(path)
    prefix = key_prefix if key_prefix is not None else path.name
    name = path.name.lower()
    kind, chunks = (("zstd", _zst_chunks) if name.endswith(".zst") else
                    ("gzip", _gz_chunks) if name.endswith(".gz") else ("jsonl", _plain_chunks))
    bad = bad_utf8 = lineno = docs = empty = odd_meta = 0
    first_bad_utf8 = 0
    odd_example = None
    nbytes = 0
    with open(path, "rb") as fh:
        stream = chunks(fh)
        pending = b""
        while True:
            try:
                buf = next(stream, None)
            except _stream_errors() as e:
                raise DataError(
                    f"{path}: corrupt or truncated {kind} data after {lineno:,} lines "
                    f"({docs:,} documents, {nbytes:,} bytes decompressed): {e}; "
                    "repair or remove the file") from None
            if buf is None:
                lines, pending = ([pending] if pending else []), b""
            else:
                nbytes += len(buf)
                lines = (pending + buf).split(b"\n")
                pending = lines.pop()
            for raw in lines:
                lineno += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    bad_utf8 += 1
                    first_bad_utf8 = first_bad_utf8 or lineno
                    line = raw.decode("utf-8", errors="replace")
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
                        warn("%s:%d: skipping malformed record (%s)", path, lineno, e)
                    continue
                meta = rec.get("meta") if isinstance(rec, dict) else None
                set_name = meta.get("pile_set_name") if isinstance(meta, dict) else None
                if meta is not None and not isinstance(meta, dict):
                    odd_meta += 1
                    odd_example = odd_example or (lineno, meta)
                if not text.strip():
                    empty += 1  # (the stream drops it: an empty document has no tokens)
                dom = str(set_name) if set_name else (domain or UNKNOWN_DOMAIN)
                docs += 1
                yield Document(dom, f"{prefix}:{lineno}", normalize_text(text))
            if buf is None:
                break
    if bad:
        warn("%s: skipped %d malformed of %d records (%d documents read)", path, bad,
             bad + docs, docs)
    if empty:
        warn("%s: dropped %d of %d records whose \"text\" is empty", path, empty, docs)
    if odd_meta:
        assert odd_example is not None
        warn("%s: %d record(s) have a \"meta\" that is not an object (first: line %d, %r), "
             "so no pile_set_name: they get domain %r", path, odd_meta, odd_example[0],
             odd_example[1], domain or UNKNOWN_DOMAIN)
    if bad_utf8:
        warn("%s: %d of %d lines were not valid UTF-8, first line %d (invalid bytes replaced "
             "by U+FFFD)", path, bad_utf8, lineno, first_bad_utf8)


def text_file_problem(data: bytes) -> str | None:
    """Why ``data`` is not a text file (too many control bytes / NULs), or None if it is one."""
    if not data:
        return None
    n = len(data)
    c0 = n - len(data.translate(None, _C0))
    try:
        data.decode("utf-8")
        c1 = 0
    except UnicodeDecodeError:  # read as Latin-1: C1 controls are not text there either
        c1 = n - len(data.translate(None, _C1))
    if c0 + c1 > MAX_CONTROL_FRACTION * n:
        nul = data.count(b"\x00")
        return (f"looks binary: {c0 + c1:,} of {n:,} bytes are control characters "
                f"({nul:,} NUL; text files have < {MAX_CONTROL_FRACTION:.0%})")
    return None


def read_text_file(path: Path, domain: str | None, key: str,
                   stats: dict[str, int] | None = None, warn: Warn = log.warning) -> Document:
    """One ``.txt`` document; a binary file raises :class:`DataError`.

    ``stats`` counts files read as Latin-1 (``latin1``) and dropped NUL bytes (``nul``).
    """
    data = path.read_bytes()
    problem = text_file_problem(data)
    if problem is not None:
        raise DataError(f"data file {path} {problem}; remove it from the source or give "
                        "only text files")
    if stats is not None:
        body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            stats["latin1"] = stats.get("latin1", 0) + 1
        nul = data.count(b"\x00")
        if nul:
            stats["nul"] = stats.get("nul", 0) + nul
            warn("%s: dropped %d NUL bytes", path, nul)
    return Document(domain or path.parent.name or UNKNOWN_DOMAIN, key, decode_text(data))


def read_user_source(path: str | os.PathLike[str], domain: str | None = None,
                     options: dict[str, str] | None = None, warn: Warn = log.warning
                     ) -> Iterator[Document]:
    """Documents under ``path`` (a file or a directory walked in sorted order).

    Keys are paths relative to the parent of ``path`` (so ``corpus/a/b.txt`` has key
    ``corpus/a/b.txt`` when ``corpus`` is given): stable wherever the directory is moved.
    """
    root = Path(path)
    try:
        root_resolved = root.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, a dangling link, a symlink loop
        if root.is_symlink():
            raise DataNotFoundError(f"data source {str(root)!r} is a symbolic link that leads "
                                    "nowhere (dangling or a loop)") from None
        raise DataNotFoundError(f"data source {str(root)!r} does not exist") from None
    base = root_resolved.parent
    if root.is_file():
        files = [root]
    elif not root.is_dir():
        raise DataError(f"data source {str(root)!r} is neither a regular file nor a directory "
                        "(a FIFO, socket or device); give a file or a directory of them")
    else:
        files, odd = [], []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                if not fn.startswith(".") and is_data_file(p):
                    # a link is followed (a data directory of links into a shared store);
                    # a loop, a dangling link, a FIFO or a device is skipped (and counted)
                    (files if p.is_file() else odd).append(p)
        if odd:
            warn("data source %s: skipped %d entr%s that %s not a readable regular file "
                 "(a dangling link, a symlink loop, a FIFO or a device), e.g. %s", root,
                 len(odd), "y" if len(odd) == 1 else "ies", "is" if len(odd) == 1 else "are",
                 odd[0])
        if not files:
            arrow = next(root.rglob("*.arrow"), None)
            warn("data source %s contains no .txt/.jsonl/.jsonl.zst/.jsonl.gz/.parquet files%s",
                 root, f" ({ARROW_HINT})" if arrow is not None else "")
    stats: dict[str, int] = {}
    n_txt = 0
    for p in files:
        # the key is where the file sits in the tree, not where a link leads (so a link into
        # a shared store outside the source works)
        rel = (root_resolved.relative_to(base) if p is root else
               Path(root_resolved.name) / p.relative_to(root)).as_posix()
        if p.name.lower().endswith(JSONL_SUFFIXES):
            yield from read_jsonl(p, domain=domain, key_prefix=rel, warn=warn)
        elif p.name.lower().endswith(PARQUET_SUFFIXES):
            yield from read_parquet(p, domain, rel, options or {})
        elif p.name.lower().endswith(TEXT_SUFFIXES):
            n_txt += 1
            yield read_text_file(p, domain, rel, stats, warn)
        else:
            hint = f"; {ARROW_HINT}" if p.name.lower().endswith(".arrow") else ""
            raise DataError(f"unsupported data file {p} (expected .txt, .jsonl, .jsonl.zst, "
                            f".jsonl.gz or .parquet){hint}")
    if stats.get("latin1"):
        warn("data source %s: %d of %d .txt files are not valid UTF-8 and were read as "
                    "Latin-1", root, stats["latin1"], n_txt)


_ROWS_PER_BATCH = 1024


def read_parquet(path: Path, domain: str | None, key_prefix: str,
                 options: dict[str, str]) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"reading {path} needs the pyarrow package (pip install pyarrow)") from e
    text_col = options.get("text", "text")
    dom_col = options.get("domain")
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    names = f.schema_arrow.names
    for col, what in ((text_col, "text"), (dom_col, "domain")):
        if col is not None and col not in names:
            raise DataError(f"{path}: no column {col!r} for the {what} (columns: "
                            f"{', '.join(names)}); name it with ?{what}=COLUMN")
    cols = [text_col] + ([dom_col] if dom_col and dom_col != text_col else [])
    row = 0
    try:
        for batch in f.iter_batches(batch_size=_ROWS_PER_BATCH, columns=cols):
            texts = batch.column(text_col).to_pylist()
            doms = batch.column(dom_col).to_pylist() if dom_col else None
            for k, text in enumerate(texts):
                if isinstance(text, str):
                    dom = domain or (str(doms[k]) if doms and doms[k] is not None else "unknown")
                    yield Document(dom, f"{key_prefix}:{row}", normalize_text(text))
                row += 1
    except OSError as e:
        raise DataError(f"{path}: corrupt or truncated Parquet data after {row:,} rows: {e}"
                        ) from None
