"""The shapes every split store shares: token dtype, :class:`Batch`, :class:`ChunkTable`.

A split's tokens are one (virtual) array: documents packed contiguously *per domain* (domains in
sorted order), each followed by EOS. :func:`chunk_table` cuts each domain's region into
non-overlapping chunks of ``seq_len + 1`` tokens (the remainder of a domain is dropped), so a
chunk never crosses a domain boundary. The sharded store (:mod:`remoe.data.shardstore`) reads
them; :mod:`remoe.data.sampler` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


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
