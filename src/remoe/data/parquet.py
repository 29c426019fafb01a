"""Parquet sources (what Hugging Face ``datasets`` stores), streamed with ``pyarrow``.

One document per row: the text column is ``text`` unless the spec names another
(``PATH?text=content``); the domain is the spec's ``NAME=``, else the value of a column the
spec names (``?domain=source``), else ``unknown``. Rows are read in record batches, so memory
does not grow with the file. Keys are ``<file key>:<row>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from remoe.data.documents import Document, normalize_text
from remoe.data.errors import DataError

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
