"""``ShardedStore``: one split of a sharded store, read like a single token array.

Opening reads only the split's segment table (one row per domain and unit) and the manifest:
the cost does not grow with the data. Shards are memory-mapped the first time a row touches
them, and each is checked against the sha256 recorded when it was written before its first
use in this process, so a damaged shard stops the run (one line naming it) before a step uses
it. The document index (``doc_offsets`` / ``doc_domains``) is mapped, and checked, on first use.
Segments of unit ``-1 - n`` are read in place from Megatron dataset ``n``'s ``.bin`` (the
manifest's ``external``), checked by size and modification time when first mapped (its sha256
is checked by ``remoe data --verify``).

A split's tokens are one (virtual) array: documents packed contiguously *per domain* (domains
in sorted order), each followed by EOS. :func:`chunk_table` cuts each domain's region into
non-overlapping chunks of ``seq_len + 1`` tokens (the remainder of a domain is dropped), so a
chunk never crosses a domain boundary; :mod:`remoe.data.sampler` draws them as :class:`Batch`\ es.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

from remoe.data.errors import DataError
from remoe.data.shards import unit_name


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` if every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


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


_HASH_CHUNK_BYTES = 1 << 24


def file_problem(path: Path, meta: dict[str, Any], *, full: bool) -> str | None:
    """None when ``path`` matches ``meta`` (size; sha256 too with ``full``), else why not."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != meta["bytes"]:
        return f"{path.name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)"
    if full:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while buf := f.read(_HASH_CHUNK_BYTES):
                h.update(buf)
        if h.hexdigest() != meta["sha256"]:
            return f"{path.name} does not match its sha256 (corrupt)"
    return None


class ShardedStore:
    """The tokens of one split of a sharded store (see the module docstring)."""

    def __init__(self, root: str | Path, split: str, domains: list[str], entry: dict[str, Any],
                 shard_files: dict[str, Any], dtype: str, external: dict[str, Any] | None = None):
        self.root = Path(root)
        self._external = dict(external or {})
        self.name = split
        self.domains = list(domains)
        self._entry = entry
        self._shard_files = shard_files
        self._dtype = np.dtype(dtype)
        seg_meta = entry["files"][f"index/{split}.segments.npy"]
        self._check(self.root / "index" / f"{split}.segments.npy", seg_meta)
        seg = np.load(self.root / "index" / f"{split}.segments.npy", allow_pickle=False)
        self.segments = seg.reshape(-1, 4)
        self._seg_starts = self.segments[:, 0].copy()
        self.domain_ranges = {d: (int(a), int(b)) for d, (a, b) in entry["domain_ranges"].items()}
        self._maps: dict[int, np.ndarray] = {}
        self._doc_index: tuple[np.ndarray, np.ndarray] | None = None
        self._chunk_cache: dict[int, ChunkTable] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"args": (self.root, self.name, self.domains, self._entry, self._shard_files,
                         self._dtype.name, self._external)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["args"])  # type: ignore[misc]

    def _check(self, path: Path, meta: dict[str, Any]) -> None:
        problem = file_problem(path, meta, full=True)
        if problem is not None:
            raise DataError(f"data store {self.root}: {problem}; run `remoe data` (or "
                            "`remoe data --verify`) to rebuild it")

    def _shard(self, unit: int) -> np.ndarray:
        arr = self._maps.get(unit)
        if arr is None and unit < 0:
            from remoe.data.megatron import external_problem

            entry = self._external[str(-1 - unit)]
            problem = external_problem(entry, full=False)
            if problem is not None:
                raise DataError(f"data store {self.root}: {problem}; run `remoe data` to "
                                "rebuild it")
            arr = np.memmap(entry["path"], dtype=np.dtype(entry["dtype"]), mode="r")
            self._maps[unit] = arr
        elif arr is None:
            name = unit_name(unit, "bin")
            path = self.root / "shards" / name
            self._check(path, self._shard_files[name])
            arr = (np.memmap(path, dtype=self._dtype, mode="r") if path.stat().st_size else
                   np.zeros(0, dtype=self._dtype))
            self._maps[unit] = arr
        return arr

    # -- sizes (from the manifest) ------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self._entry["num_tokens"])

    @property
    def num_docs(self) -> int:
        return int(self._entry["num_docs"])

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def tokens_per_domain(self) -> dict[str, int]:
        return dict(self._entry["tokens_per_domain"])

    def docs_per_domain(self) -> dict[str, int]:
        return {d: int(n) for d, n in self._entry["docs_per_domain"].items() if n}

    # -- reading --------------------------------------------------------------------------------
    def read(self, start: int, length: int) -> np.ndarray:
        """Virtual tokens ``[start, start + length)`` as int64."""
        out = np.empty(length, dtype=np.int64)
        pos, done = start, 0
        i = int(np.searchsorted(self._seg_starts, pos, side="right")) - 1
        while done < length:
            vstart, unit, off, n = (int(x) for x in self.segments[i])
            take = min(length - done, vstart + n - pos)
            a = off + pos - vstart
            out[done: done + take] = self._shard(unit)[a: a + take]
            done += take
            pos += take
            i += 1
        return out

    @property
    def tokens(self) -> "VirtualTokens":
        """The split's tokens, sliceable like one array (each slice an int64 copy)."""
        return VirtualTokens(self)

    def _docs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._doc_index is None:
            arrs = []
            for what in ("doc_offsets", "doc_domains"):
                path = self.root / "index" / f"{self.name}.{what}.npy"
                self._check(path, self._entry["files"][f"index/{path.name}"])
                arrs.append(np.load(path, mmap_mode="r", allow_pickle=False))
            self._doc_index = (arrs[0], arrs[1])
        return self._doc_index

    @property
    def doc_offsets(self) -> np.ndarray:
        return self._docs()[0]

    @property
    def doc_domains(self) -> np.ndarray:
        return self._docs()[1]

    def document(self, i: int, *, with_eos: bool = False) -> np.ndarray:
        offs = self.doc_offsets
        a, b = int(offs[i]), int(offs[i + 1])
        return self.read(a, (b if with_eos else b - 1) - a)

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
        out = np.zeros((ids.size, span), dtype=np.int64)
        for r, start in enumerate(table.offsets[ids]):
            out[r] = self.read(int(start), span)
        return Batch(torch.from_numpy(out), torch.from_numpy(table.domain_ids[ids].copy()))


class VirtualTokens:
    """``store.tokens[a:b]`` / ``store.tokens[i]`` over a :class:`ShardedStore`."""

    def __init__(self, store: ShardedStore):
        self.store = store
        self.shape = (store.num_tokens,)
        self.dtype = store.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: int | slice) -> np.ndarray:
        if isinstance(key, slice):
            a, b, step = key.indices(self.shape[0])
            return self.store.read(a, max(0, b - a))[::step]
        i = int(key) + (self.shape[0] if int(key) < 0 else 0)
        return self.store.read(i, 1)[0]
