"""Exact-duplicate detection in bounded memory: 64-bit text fingerprints in sorted runs.

Fingerprints (blake2b-64 of a document's UTF-8 text) go to a small pending set, which is merged
into one sorted in-memory run; once that run holds ``max_memory_entries`` it is written to disk
as a sorted run of raw little-endian ``uint64`` and dropped from memory. What stays in memory for
a disk run is its *fence* (the first fingerprint of every 4 KiB block: 1/512 of the run) and, for
all disk runs together, one Bloom filter of ``bloom_bits`` bits (7 hashes), allocated at the
first spill. A membership test on disk is made only when the Bloom filter says "maybe": one
``pread`` of one block per run, never a memory map, so the resident set does not grow with the
files. Memory is therefore bounded by ``max_memory_entries * 8`` bytes (twice that while a merge
copies the run), ``bloom_bits / 8`` bytes and 16 bytes per 512 unique documents; disk holds
8 bytes per unique document. At the paper's scale (~30M documents) the default filter answers
"maybe" for ~1 new document in 10^7; at the whole Pile (~210M) for ~0.7%. Two different texts
share a fingerprint with probability ~n^2 / 2^65 (1e-4 at 50M documents).

Only the plan pass fingerprints: it records every answer (:class:`RecordedFingerprints`, one
byte per document offered), and the later passes over the same stream replay them
(:class:`ReplayedFingerprints`), so they hold no fingerprint set at all.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

DEFAULT_MAX_MEMORY_ENTRIES = 8 << 20  # 64 MiB of fingerprints in RAM
DEFAULT_BLOOM_BITS = 1 << 31  # 256 MiB, only once a run has been spilled to disk
_BLOCK = 512  # fingerprints per disk block (4 KiB): one pread per run per lookup
_HASHES = 7
_PENDING = 65536


def text_fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class _DiskRun:
    """A sorted run of fingerprints on disk, read one block at a time."""

    def __init__(self, path: Path, keys: np.ndarray):
        tmp = path.with_name(path.name + ".tmp")
        keys.astype("<u8", copy=False).tofile(tmp)
        os.replace(tmp, path)
        self.fence = keys[::_BLOCK].copy()
        self.fd = os.open(path, os.O_RDONLY)

    def __contains__(self, key: np.uint64) -> bool:
        b = int(np.searchsorted(self.fence, key, side="right")) - 1
        if b < 0:
            return False
        block = np.frombuffer(os.pread(self.fd, _BLOCK * 8, b * _BLOCK * 8), dtype="<u8")
        i = int(np.searchsorted(block, key))
        return i < block.shape[0] and block[i] == key

    def close(self) -> None:
        os.close(self.fd)


class SeenFingerprints:
    """A set of 64-bit fingerprints that spills sorted runs to ``spill_dir``; the pending set
    is merged into the sorted run every ``merge_every`` new fingerprints."""

    def __init__(self, spill_dir: Path, max_memory_entries: int = DEFAULT_MAX_MEMORY_ENTRIES,
                 bloom_bits: int = DEFAULT_BLOOM_BITS, merge_every: int = _PENDING):
        self.spill_dir = Path(spill_dir)
        self.merge_every = max(1, int(merge_every))
        self.max_memory_entries = max(16, int(max_memory_entries))
        self.bloom_bits = max(64, -(-int(bloom_bits) // 8) * 8)
        self._pending: set[int] = set()
        self._memory_run = np.zeros(0, dtype=np.uint64)
        self._disk_runs: list[_DiskRun] = []
        self._bloom: bytearray | None = None

    def __contains__(self, fp: int) -> bool:
        if fp in self._pending:
            return True
        key = np.uint64(fp)
        run = self._memory_run
        i = int(np.searchsorted(run, key))
        if i < run.shape[0] and run[i] == key:
            return True
        if not self._disk_runs or not self._maybe_on_disk(fp):
            return False
        return any(key in r for r in self._disk_runs)

    def _maybe_on_disk(self, fp: int) -> bool:
        bloom, m = self._bloom, self.bloom_bits
        assert bloom is not None
        h1, h2 = fp & 0xFFFFFFFF, (fp >> 32) | 1
        for i in range(_HASHES):
            p = (h1 + i * h2) % m
            if not bloom[p >> 3] & (1 << (p & 7)):
                return False
        return True

    def _bloom_add(self, keys: np.ndarray) -> None:
        if self._bloom is None:
            self._bloom = bytearray(self.bloom_bits // 8)
        bits = np.frombuffer(self._bloom, dtype=np.uint8)
        m = np.uint64(self.bloom_bits)
        for a in range(0, keys.shape[0], 1 << 20):  # 1M keys at a time: small temporaries
            chunk = keys[a: a + (1 << 20)]
            h1 = chunk & np.uint64(0xFFFFFFFF)
            h2 = (chunk >> np.uint64(32)) | np.uint64(1)
            for i in range(_HASHES):
                p = (h1 + np.uint64(i) * h2) % m
                np.bitwise_or.at(bits, p >> np.uint64(3),
                                 np.left_shift(np.uint8(1), (p & np.uint64(7)).astype(np.uint8)))

    def add(self, fp: int) -> None:
        """Remember ``fp`` (one not seen before: :meth:`add_if_new` checks)."""
        self._pending.add(fp)
        if len(self._pending) >= self.merge_every:
            self._merge_pending()

    def _merge_pending(self) -> None:
        new = np.sort(np.fromiter(self._pending, dtype=np.uint64, count=len(self._pending)))
        self._pending.clear()
        run = self._memory_run
        self._memory_run = np.insert(run, np.searchsorted(run, new), new)  # one new copy
        if self._memory_run.shape[0] >= self.max_memory_entries:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            path = self.spill_dir / f"run{len(self._disk_runs):05d}.u64"
            self._disk_runs.append(_DiskRun(path, self._memory_run))
            self._bloom_add(self._memory_run)
            self._memory_run = np.zeros(0, dtype=np.uint64)

    def add_if_new(self, text: str) -> bool:
        """True (and remembered) if ``text`` was not seen before."""
        fp = text_fingerprint(text)
        if fp in self:
            return False
        self.add(fp)
        return True

    def close(self) -> None:
        for r in self._disk_runs:
            r.close()
        self._disk_runs.clear()

    def __del__(self) -> None:  # a set nobody closed still gives its file descriptors back
        self.close()


class RecordedFingerprints:
    """:class:`SeenFingerprints` whose every answer is also written, one byte each (1 new,
    0 duplicate), to ``out``: the plan pass records them so that later passes replay them."""

    def __init__(self, seen: SeenFingerprints, out: BinaryIO):
        self.seen = seen
        self.out = out

    def add_if_new(self, text: str) -> bool:
        new = self.seen.add_if_new(text)
        self.out.write(b"\x01" if new else b"\x00")
        return new


class ReplayedFingerprints:
    """The answers a :class:`RecordedFingerprints` wrote, in order, read back in 64 KiB blocks:
    no fingerprint is computed or held (memory and time do not grow with the corpus)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        self._buf = b""
        self._pos = 0

    def add_if_new(self, text: str) -> bool:
        if self._pos >= len(self._buf):
            self._buf, self._pos = self._f.read(1 << 16), 0
            if not self._buf:
                from remoe.data.errors import DataError

                raise DataError(f"{self.path} ends early: the data sources changed since the "
                                "plan was made; run `remoe data` again")
        self._pos += 1
        return self._buf[self._pos - 1] == 1

    def close(self) -> None:
        self._f.close()
