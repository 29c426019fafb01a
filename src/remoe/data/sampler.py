"""Training batches as a pure function of (seed, step, micro step, rank) and eval batches.

Global sample index of row ``i`` of rank ``r``'s micro batch ``m`` at optimizer step ``s``::

    g = (s * grad_accum + m) * (world_size * micro_batch) + r * micro_batch + i

so rank ``r`` gets the ``r``-th slice of what a single process with a micro batch of
``world_size * micro_batch`` would get: 1 process with micro batch 2b and 2 processes with b
see exactly the same samples at every step. Sample ``g`` is chunk ``perm_e[g mod N]`` of epoch
``e = g // N``, where ``perm_e`` is a permutation of the ``N`` chunks drawn by
``numpy.random.default_rng([seed, e])``. Resuming needs only the step number.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from typing import Iterator

import numpy as np
import torch

from remoe.data.errors import DataError
from remoe.data.shardstore import ShardedStore
from remoe.data.shardstore import Batch, ChunkTable


class TrainBatches:
    """Deterministic, resumable training batches over a :class:`~remoe.data.shardstore.ShardedStore`.

    ``batch(step, micro_step, rank)`` returns a :class:`Batch` with ``input_ids`` int64
    ``[micro_batch, seq_len + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``) and
    ``domain_ids`` int64 ``[micro_batch]``.
    """

    def __init__(self, store: ShardedStore, seq_len: int, micro_batch: int, grad_accum: int = 1,
                 world_size: int = 1, seed: int = 0):
        for name, v, lo in (("seq_len", seq_len, 1), ("micro_batch", micro_batch, 1),
                            ("grad_accum", grad_accum, 1), ("world_size", world_size, 1),
                            ("seed", seed, 0)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
        self.store = store
        self.seq_len = int(seq_len)
        self.micro_batch = int(micro_batch)
        self.grad_accum = int(grad_accum)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.table: ChunkTable = store.chunks(self.seq_len)
        if len(self.table) == 0:
            raise DataError(
                f"split {store.name!r} has no chunk of {self.seq_len + 1} tokens "
                f"({store.num_tokens} tokens in total): use a shorter seq_len or more data")
        self.num_chunks = len(self.table)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def samples_per_step(self) -> int:
        """Samples in one optimizer step over all ranks and micro steps."""
        return self.grad_accum * self.world_size * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * self.seq_len

    def permutation(self, epoch: int) -> np.ndarray:
        """The chunk order of ``epoch`` (a pure function of ``(seed, epoch)``)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, int(epoch)])
            perm = rng.permutation(self.num_chunks)
            self._perms[epoch] = perm
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def global_indices(self, step: int, micro_step: int = 0, rank: int = 0) -> np.ndarray:
        """Global sample indices of one micro batch (see the module docstring)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if not 0 <= micro_step < self.grad_accum:
            raise ValueError(f"micro_step={micro_step} must be in [0, {self.grad_accum})")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must be in [0, {self.world_size})")
        base = ((step * self.grad_accum + micro_step) * (self.world_size * self.micro_batch)
                + rank * self.micro_batch)
        return base + np.arange(self.micro_batch, dtype=np.int64)

    def chunk_indices(self, step: int, micro_step: int = 0, rank: int = 0) -> np.ndarray:
        """Indices into the chunk table of one micro batch."""
        g = self.global_indices(step, micro_step, rank)
        n = self.num_chunks
        epochs, pos = g // n, g % n
        out = np.empty_like(g)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[pos[sel]]
        return out

    def batch(self, step: int, micro_step: int = 0, rank: int = 0) -> Batch:
        return self.store.gather(self.table, self.chunk_indices(step, micro_step, rank))

    __call__ = batch

    def epoch(self, step: int) -> float:
        """Fractional epoch reached at the start of ``step``."""
        return step * self.samples_per_step / self.num_chunks


def device_batches(sampler, step: int, rank: int, grad_accum: int, device: torch.device,
                   pin_memory: bool = False, prefetch: bool = False,
                   stream=None) -> Iterator[torch.Tensor]:
    """Step ``step``'s ``grad_accum`` micro-batches of rank ``rank`` (``input_ids``) on
    ``device``, in order, from ``sampler.batch(step, micro, rank)`` (a :class:`TrainBatches`, or
    anything with that method). ``pin_memory`` (CUDA): copied from pinned host memory, so the
    copy does not block the host. ``prefetch``: each batch is read and its copy issued before
    the one before it is computed; on CUDA on ``stream``, which the compute stream waits for.
    The batches are the same either way (they are read by index)."""

    def load(micro: int) -> torch.Tensor:
        ids, _ = sampler.batch(step, micro, rank)
        if pin_memory and device.type == "cuda":
            ids = ids.pin_memory()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            return ids.to(device, non_blocking=True)

    nxt = load(0)
    for micro in range(grad_accum):
        cur, more = nxt, micro + 1 < grad_accum
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
            cur.record_stream(torch.cuda.current_stream())
        if more and prefetch:
            nxt = load(micro + 1)
        yield cur
        if more and not prefetch:
            nxt = load(micro + 1)


def eval_chunk_indices(table: ChunkTable, num_domains: int,
                       max_chunks_per_domain: int | None = None) -> np.ndarray:
    """Chunk indices for evaluation: per domain all chunks, or ``max_chunks_per_domain``
    evenly spaced ones (domain by domain, in domain order)."""
    picked = []
    for dom in range(num_domains):
        idx = table.indices_of_domain(dom)
        n = idx.size
        if max_chunks_per_domain is not None and n > max_chunks_per_domain:
            m = max_chunks_per_domain
            idx = idx[((2 * np.arange(m, dtype=np.int64) + 1) * n) // (2 * m)]
        picked.append(idx)
    return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)


def eval_batches(store: ShardedStore, seq_len: int, batch_size: int,
                 max_chunks_per_domain: int | None = None) -> Iterator[Batch]:
    """Deterministic evaluation batches of ``store`` covering every domain.

    Yields :class:`Batch` objects of at most ``batch_size`` rows (the last may be smaller).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if max_chunks_per_domain is not None and max_chunks_per_domain < 1:
        raise ValueError(f"max_chunks_per_domain={max_chunks_per_domain} must be >= 1")
    table = store.chunks(seq_len)
    ids = eval_chunk_indices(table, len(store.domains), max_chunks_per_domain)
    for i in range(0, ids.size, batch_size):
        yield store.gather(table, ids[i : i + batch_size])
