"""Exact-duplicate detection in bounded memory: 64-bit text fingerprints in sorted runs.

Fingerprints (blake2b-64 of a document's UTF-8 text) are collected in a small in-memory
buffer, merged into one sorted in-memory run, and that run is written to disk as a sorted
``.npy`` run once it holds ``max_memory_entries``; membership is a binary search in each run
(disk runs memory-mapped). Memory is bounded by ``max_memory_entries * 8`` bytes plus the
page cache the kernel gives the mapped runs; disk holds 8 bytes per unique document. Two
different texts share a fingerprint with probability ~n^2 / 2^65 (1e-4 at 50M documents).

Only the plan pass fingerprints: it records every answer (:class:`RecordedFingerprints`, one
byte per document offered), and the later passes over the same stream replay them
(:class:`ReplayedFingerprints`), so they hold no fingerprint set at all.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

DEFAULT_MAX_MEMORY_ENTRIES = 16 << 20  # 128 MiB of fingerprints in RAM


def text_fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class SeenFingerprints:
    """A set of 64-bit fingerprints that spills sorted runs to ``spill_dir``."""

    def __init__(self, spill_dir: Path, max_memory_entries: int = DEFAULT_MAX_MEMORY_ENTRIES):
        self.spill_dir = Path(spill_dir)
        self.max_memory_entries = max(16, int(max_memory_entries))
        self._pending: set[int] = set()
        self._memory_run = np.zeros(0, dtype=np.uint64)
        self._disk_runs: list[np.ndarray] = []

    def __contains__(self, fp: int) -> bool:
        if fp in self._pending:
            return True
        key = np.uint64(fp)
        for run in (self._memory_run, *self._disk_runs):
            i = int(np.searchsorted(run, key))
            if i < run.shape[0] and run[i] == key:
                return True
        return False

    def add(self, fp: int) -> None:
        self._pending.add(fp)
        if len(self._pending) >= 65536:
            self._merge_pending()

    def _merge_pending(self) -> None:
        new = np.fromiter(self._pending, dtype=np.uint64, count=len(self._pending))
        self._pending.clear()
        self._memory_run = np.union1d(self._memory_run, new)
        if self._memory_run.shape[0] >= self.max_memory_entries:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            path = self.spill_dir / f"run{len(self._disk_runs):05d}.npy"
            np.save(path, self._memory_run, allow_pickle=False)
            self._disk_runs.append(np.load(path, mmap_mode="r", allow_pickle=False))
            self._memory_run = np.zeros(0, dtype=np.uint64)

    def add_if_new(self, text: str) -> bool:
        """True (and remembered) if ``text`` was not seen before."""
        fp = text_fingerprint(text)
        if fp in self:
            return False
        self.add(fp)
        return True


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
