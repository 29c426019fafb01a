"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read in place as documents.

The ``.idx`` file (Megatron-core ``IndexedDataset``) holds, after a 9-byte magic
``MMIDIDX\\0\\0``: a little-endian ``uint64`` version (1), a ``uint8`` dtype code, the
sequence count and the document count (``uint64`` each), then ``int32`` sequence lengths,
``int64`` byte offsets of the sequences in ``.bin``, and ``int64`` document boundaries (in
sequences, starting at 0). Every array is memory-mapped: opening costs the same at any size.
A document is the tokens of its sequences; its key is ``NAME:<index>``.

Train documents that already end with the end-of-text token are *referenced* by the store, not
copied (:mod:`remoe.data.shards`): each such document carries its ``origin`` (the dataset's
number among the Megatron sources, its index, its first token in ``.bin``), and training reads
the ``.bin`` memory-mapped in place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from remoe.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@dataclass(frozen=True)
class TokenDocument:
    """A document that is already token ids (``ids`` 1-D integer array, no text)."""

    domain: str
    key: str
    ids: np.ndarray
    origin: tuple[int, int, int] | None = None  # (dataset number, document, first token)

    @property
    def num_bytes(self) -> int:
        return 0

    @property
    def text(self) -> None:
        return None


def megatron_prefix(path: str) -> Path | None:
    """The dataset prefix when ``path`` (a prefix, or its ``.bin`` / ``.idx``) is one."""
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    if Path(f"{p}.bin").is_file() and Path(f"{p}.idx").is_file():
        return p
    return None


def is_megatron_spec(spec) -> bool:
    return spec.kind == "path" and spec.path is not None and megatron_prefix(spec.path) is not None


class MegatronDataset:
    """The index and token file of one Megatron indexed dataset, memory-mapped."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        idx = Path(f"{self.prefix}.idx")
        with open(idx, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_MAGIC:
            raise DataError(f"{idx} is not a Megatron index (no MMIDIDX header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in _DTYPES:
            raise DataError(f"{idx}: unsupported Megatron index (version {version}, dtype code "
                            f"{code})")
        self.dtype = np.dtype(_DTYPES[code])
        need = 34 + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx.stat().st_size < need:
            raise DataError(f"{idx} is truncated ({idx.stat().st_size} bytes, needs {need})")
        self.seq_lengths = np.memmap(idx, dtype="<i4", mode="r", offset=34, shape=(n_seq,))
        self.seq_pointers_bytes = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 4 * n_seq,
                                            shape=(n_seq,))
        self.doc_bounds = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 12 * n_seq,
                                    shape=(n_doc,))
        bin_path = Path(f"{self.prefix}.bin")
        n_bytes = bin_path.stat().st_size
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if n_bytes else
                       np.zeros(0, dtype=self.dtype))
        if n_seq and int(self.seq_pointers_bytes[-1]) + int(self.seq_lengths[-1]) * (
                self.dtype.itemsize) > n_bytes:
            raise DataError(f"{bin_path} is shorter than its index says (truncated?)")

    @property
    def num_docs(self) -> int:
        return max(0, int(self.doc_bounds.shape[0]) - 1)

    def span(self, i: int) -> tuple[int, int]:
        """Document ``i`` is tokens ``[start, end)`` of ``.bin``."""
        a, b = int(self.doc_bounds[i]), int(self.doc_bounds[i + 1])
        if b <= a:
            return 0, 0
        start = int(self.seq_pointers_bytes[a]) // self.dtype.itemsize
        return start, int(self.seq_pointers_bytes[b - 1]) // self.dtype.itemsize + int(
            self.seq_lengths[b - 1])

    def document(self, i: int) -> np.ndarray:
        start, end = self.span(i)
        return np.asarray(self.tokens[start:end])

    def doc_lengths(self, first: int, stop: int) -> np.ndarray:
        """``int64`` token counts of documents ``[first, stop)`` (memory: those only)."""
        b = np.asarray(self.doc_bounds[first: stop + 1], dtype=np.int64)
        n_seq = self.seq_lengths.shape[0]
        if n_seq == 0:
            return np.zeros(stop - first, dtype=np.int64)
        lo, hi = b[:-1].clip(0, n_seq - 1), (b[1:] - 1).clip(0, n_seq - 1)
        size = self.dtype.itemsize
        ptr = self.seq_pointers_bytes
        ends = np.asarray(ptr[hi], dtype=np.int64) // size + np.asarray(
            self.seq_lengths[hi], dtype=np.int64)
        return np.where(b[1:] > b[:-1], ends - np.asarray(ptr[lo], dtype=np.int64) // size, 0)


def megatron_prefixes(sources: list[str]) -> list[Path]:
    """The Megatron datasets among ``sources``, in order: their *dataset numbers*."""
    from remoe.data.corpus import parse_source

    out = []
    for s in sources:
        spec = parse_source(s)
        if is_megatron_spec(spec):
            prefix = megatron_prefix(str(spec.path))
            assert prefix is not None
            out.append(prefix)
    return out


def read_megatron(prefix: Path, domain: str, number: int = 0) -> Iterator[TokenDocument]:
    ds = MegatronDataset(prefix)
    for i in range(ds.num_docs):
        start, end = ds.span(i)
        yield TokenDocument(domain, f"{prefix.name}:{i}", np.asarray(ds.tokens[start:end]),
                            (number, i, start))


def external_entries(prefixes: list[Path], used: list[int], record: list[dict]
                     ) -> dict[str, dict]:
    """The manifest's record of the Megatron ``.bin`` files a store reads in place: path,
    dtype, size, modification time, sha256 and id range, as taken when the build began
    (:func:`remoe.data.sourcecheck.record_sources`)."""
    by_path = {e["path"]: e for e in record}
    out = {}
    for n in used:
        e = by_path[str(Path(f"{prefixes[n]}.bin").resolve())]
        out[str(n)] = {k: e[k] for k in ("path", "dtype", "bytes", "mtime_ns", "sha256",
                                         "min_id", "max_id")}
    return out


def external_problem(entry: dict, *, full: bool) -> str | None:
    """None when the in-place ``.bin`` of ``entry`` is as recorded (size and modification
    time; its sha256 too with ``full``), else why not."""
    from remoe.data._io import file_change

    return file_change({**entry, "dtype": entry.get("dtype", "")}, full=full)
