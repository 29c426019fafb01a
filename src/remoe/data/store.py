"""Packed, memory-mapped token stores (one per split) and their chunk tables.

Layout of a split ``S`` under ``<cache_dir>/tokens/``:

* ``S.tokens.npy``      -- every document's tokens followed by EOS, documents packed
  contiguously *per domain* (domains in sorted order, documents by key), ``uint16`` when the
  vocabulary fits in 16 bits, else ``uint32``;
* ``S.doc_offsets.npy`` -- ``int64[num_docs + 1]``: document ``i`` is
  ``tokens[doc_offsets[i]:doc_offsets[i+1]]`` (its EOS included); documents are in the same
  order as the lines of ``corpus/S.jsonl``;
* ``S.doc_domains.npy`` -- ``int32[num_docs]``: index into the global domain list.

The arrays do not depend on the sequence length. :meth:`TokenStore.chunks` cuts each domain's
region into non-overlapping chunks of ``seq_len + 1`` tokens at load time (the remainder of a
domain is dropped), so a chunk never crosses a domain boundary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, NamedTuple

import numpy as np

from remoe.data._io import atomic_write_with, sha256_file
from remoe.data.documents import Document

log = logging.getLogger("remoe.data")

TOKEN_FILES = ("tokens", "doc_offsets", "doc_domains")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` if every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def split_file(directory: Path, split: str, what: str) -> Path:
    return directory / f"{split}.{what}.npy"


class Batch(NamedTuple):
    """``input_ids``: int64 ``[B, seq_len + 1]``; ``domain_ids``: int64 ``[B]``."""

    input_ids: Any
    domain_ids: Any


@dataclass(frozen=True)
class ChunkTable:
    """Fixed-length chunks of one split: start offsets and domain ids (parallel arrays)."""

    seq_len: int
    offsets: np.ndarray  # int64 [num_chunks]
    domain_ids: np.ndarray  # int64 [num_chunks]

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def indices_of_domain(self, domain_id: int) -> np.ndarray:
        return np.flatnonzero(self.domain_ids == domain_id)




def chunk_table(domains, domain_ranges: dict, seq_len: int) -> ChunkTable:
    """Chunks of ``seq_len + 1`` tokens, domain by domain (in ``domains`` order), never crossing a
    domain: ``domain_ranges[dom] = (first token, end)``."""
    span = seq_len + 1
    offs, doms = [], []
    for i, dom in enumerate(domains):
        if dom not in domain_ranges:
            continue
        a, b = domain_ranges[dom]
        n = (b - a) // span
        offs.append(a + span * np.arange(n, dtype=np.int64))
        doms.append(np.full(n, i, dtype=np.int64))
    return ChunkTable(seq_len, np.concatenate(offs) if offs else np.zeros(0, dtype=np.int64),
                      np.concatenate(doms) if doms else np.zeros(0, dtype=np.int64))

class TokenStore:
    """The memory-mapped token arrays of one split (see the module docstring)."""

    def __init__(self, directory: str | Path, split: str, domains: list[str]):
        self.directory = Path(directory)
        self.name = split
        self.domains = list(domains)
        self.tokens = _load_array(split_file(self.directory, split, "tokens"), mmap=True)
        self.doc_offsets = _load_array(split_file(self.directory, split, "doc_offsets"))
        self.doc_domains = _load_array(split_file(self.directory, split, "doc_domains"))
        if self.doc_offsets.shape[0] != self.doc_domains.shape[0] + 1 or (
                int(self.doc_offsets[-1]) != self.tokens.shape[0]):
            raise ValueError(f"token store {self.directory}/{split}.* is inconsistent")
        self._chunk_cache: dict[int, ChunkTable] = {}
        # contiguous token range of each domain
        self.domain_ranges: dict[str, tuple[int, int]] = {}
        for i, dom in enumerate(self.domains):
            docs = np.flatnonzero(self.doc_domains == i)
            if docs.size:
                a, b = int(self.doc_offsets[docs[0]]), int(self.doc_offsets[docs[-1] + 1])
                if b - a != int((self.doc_offsets[docs + 1] - self.doc_offsets[docs]).sum()):
                    raise ValueError(f"domain {dom!r} is not contiguous in {split}")
                self.domain_ranges[dom] = (a, b)

    def __getstate__(self) -> dict[str, Any]:
        # pickled (e.g. into DataLoader workers) as its location: the memmap is reopened
        return {"directory": self.directory, "name": self.name, "domains": self.domains}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["name"], state["domains"])  # type: ignore[misc]

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_domains.shape[0])

    @property
    def dtype(self) -> np.dtype:
        return self.tokens.dtype

    def tokens_per_domain(self) -> dict[str, int]:
        return {d: b - a for d, (a, b) in self.domain_ranges.items()}

    def docs_per_domain(self) -> dict[str, int]:
        counts = np.bincount(self.doc_domains, minlength=len(self.domains)) if self.num_docs else (
            np.zeros(len(self.domains), dtype=np.int64))
        return {d: int(counts[i]) for i, d in enumerate(self.domains) if counts[i]}

    def document(self, i: int, *, with_eos: bool = False) -> np.ndarray:
        """Token ids of document ``i`` (in corpus order), without its trailing EOS by default."""
        a, b = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        return np.asarray(self.tokens[a : b if with_eos else b - 1])

    # -- chunks -------------------------------------------------------------------------------
    def chunks(self, seq_len: int) -> ChunkTable:
        """Chunks of ``seq_len + 1`` tokens, domain by domain, never crossing a domain."""
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if seq_len not in self._chunk_cache:
            self._chunk_cache[seq_len] = chunk_table(self.domains, self.domain_ranges, seq_len)
        return self._chunk_cache[seq_len]

    def gather(self, table: ChunkTable, chunk_ids: Iterable[int] | np.ndarray) -> Batch:
        """The chunks ``chunk_ids`` of ``table`` as a :class:`Batch` of torch tensors."""
        import torch

        ids = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
        span = table.seq_len + 1
        if ids.size:
            positions = table.offsets[ids][:, None] + np.arange(span, dtype=np.int64)[None, :]
            out = np.asarray(self.tokens[positions], dtype=np.int64)
        else:
            out = np.zeros((0, span), dtype=np.int64)
        return Batch(torch.from_numpy(out), torch.from_numpy(table.domain_ids[ids].copy()))


def _load_array(path: Path, mmap: bool = False) -> np.ndarray:
    if mmap:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return arr
    return np.load(path, allow_pickle=False)


def _save_array(path: Path, arr: np.ndarray) -> dict[str, Any]:
    def writer(f: BinaryIO) -> None:
        np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)

    atomic_write_with(path, writer)
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def build_split_store(directory: Path, split: str, docs: list[Document], domains: list[str],
                      encode_batch: Callable[[list[str]], list[list[int]]], eos_id: int,
                      dtype: np.dtype, *, batch_bytes: int = 1 << 20,
                      progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Tokenise ``docs`` (sorted by domain, key) into the three arrays of ``split``.

    Returns the split's manifest entry: sizes per domain and sha256 + size of each file.
    """
    dom_index = {d: i for i, d in enumerate(domains)}
    for a, b in zip(docs, docs[1:]):
        if (a.domain, a.key) > (b.domain, b.key):
            raise ValueError("documents must be sorted by (domain, key)")
    max_id = np.iinfo(dtype).max
    pieces: list[np.ndarray] = []
    lengths = np.zeros(len(docs), dtype=np.int64)
    doc_domains = np.array([dom_index[d.domain] for d in docs], dtype=np.int32)
    eos = np.array([eos_id], dtype=dtype)
    i = 0
    while i < len(docs):
        j, size = i, 0
        while j < len(docs) and (j == i or size < batch_bytes):
            size += len(docs[j].text)
            j += 1
        encoded = encode_batch([d.text for d in docs[i:j]])
        for k, ids in enumerate(encoded):
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.max() > max_id or arr.min() < 0):
                raise ValueError(f"token id {int(arr.max())} does not fit in {dtype}")
            pieces.append(arr.astype(dtype))
            pieces.append(eos)
            lengths[i + k] = arr.size + 1
        if progress is not None:
            progress(sum(len(d.text) for d in docs[i:j]))
        i = j
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    doc_offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_offsets[1:])
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "tokens": _save_array(split_file(directory, split, "tokens"), tokens),
        "doc_offsets": _save_array(split_file(directory, split, "doc_offsets"), doc_offsets),
        "doc_domains": _save_array(split_file(directory, split, "doc_domains"), doc_domains),
    }
    tok_per_dom: dict[str, int] = {}
    docs_per_dom: dict[str, int] = {}
    for d, n in zip(docs, lengths):
        tok_per_dom[d.domain] = tok_per_dom.get(d.domain, 0) + int(n)
        docs_per_dom[d.domain] = docs_per_dom.get(d.domain, 0) + 1
    return {
        "num_tokens": int(tokens.shape[0]),
        "num_docs": len(docs),
        "dtype": np.dtype(dtype).name,
        "tokens_per_domain": tok_per_dom,
        "docs_per_domain": docs_per_dom,
        "files": files,
    }


def verify_split_files(directory: Path, split: str, entry: dict[str, Any]) -> str | None:
    """None if every file of ``split`` matches its manifest entry, else what is wrong.

    Checks existence, byte size and the full sha256 (about 0.1 s per 50 MB).
    """
    files = entry.get("files") or {}
    for what in TOKEN_FILES:
        meta = files.get(what)
        path = split_file(directory, split, what)
        if meta is None:
            return f"manifest has no entry for {path.name}"
        if not path.is_file():
            return f"{path.name} is missing"
        size = path.stat().st_size
        if size != meta.get("bytes"):
            return f"{path.name} has {size} bytes, manifest says {meta.get('bytes')} (truncated?)"
        if sha256_file(path) != meta.get("sha256"):
            return f"{path.name} does not match its sha256 (corrupt)"
    return None
