"""Permute / unpermute primitives between token order and expert order.

Legend: T tokens, D model width, N experts, P active (token, expert) pairs, R rows of a
blocked layout (P plus padding).
Only active pairs are ever materialised, so the cost follows P, not T*N.

Two consumers:

* the unfused backends (``reference``, ``grouped_mm``) use :func:`permute` / :func:`unpermute`
  on a jagged ``[P, D]`` copy of the inputs;
* the fused CPU backend (:mod:`remoe.model.experts`) never materialises ``[P, D]``: it walks a
  :class:`BlockLayout`, i.e. consecutive runs of experts ("chunks") sized to stay in cache,
  each either *padded* (every expert of the chunk gets the same number of rows, so one
  ``torch.bmm`` covers the chunk) or *jagged* (one matmul per expert, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass
class Chunk:
    """A run of experts ``[e0, e1)`` occupying rows ``[r0, r1)`` of a :class:`BlockLayout`.

    ``m > 0``: padded, ``(e1 - e0) x m`` rows (expert ``e`` owns ``r0 + (e - e0) * m ...``);
    ``m == 0``: jagged, expert ``e`` owns its ``counts[e]`` rows in order.
    """

    e0: int
    e1: int
    r0: int
    r1: int
    m: int

    @property
    def padded(self) -> bool:
        return self.m > 0


@dataclass
class BlockLayout:
    """Row layout of the fused expert kernels (see module docstring)."""

    tok_R: Tensor  # int64 [R]: source token of each row (padding rows: token 0, gate 0)
    row_P: Tensor  # int64 [P]: row of each pair (pairs in Dispatch order)
    chunks: list[Chunk]
    counts: list[int]  # host copy of counts_N
    num_rows: int  # R

    @property
    def num_padding(self) -> int:
        return self.num_rows - self.row_P.numel()


@dataclass
class Dispatch:
    """Where each active (token, expert) pair lives once sorted by expert."""

    token_idx_P: Tensor  # int64 [P]: source token of each pair, grouped by expert
    expert_idx_P: Tensor  # int64 [P]: expert of each pair (non-decreasing)
    counts_N: Tensor  # int64 [N]: pairs per expert (tokens routed to it)
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def num_pairs(self) -> int:
        return self.token_idx_P.numel()

    def layout(self, max_rows: int, pad_limit: float = 1.25, small_group: int = 96,
               small_pad_limit: float = 2.0) -> BlockLayout:
        """The (cached) :class:`BlockLayout` for chunks of at most ``max_rows`` rows."""
        key = (max_rows, pad_limit, small_group, small_pad_limit)
        if key not in self._layouts:
            self._layouts[key] = block_layout(self, max_rows, pad_limit, small_group,
                                              small_pad_limit)
        return self._layouts[key]


def plan(mask_TN: Tensor, num_pairs: int | None = None, on_device: bool | None = None) -> Dispatch:
    """Group the active pairs of a boolean ``[T, N]`` mask by expert (tokens ascending inside).

    ``on_device`` (default: the mask is not on the CPU) keeps the plan on the mask's device
    without a host synchronisation when ``num_pairs``, the number of active pairs, is known on
    the host (fixed-k routers: ``Routing.num_pairs``): ``nonzero_static`` with that size, counts
    by a column sum. With ``num_pairs=None`` the pair count is data-dependent and ``nonzero``
    reads it back: one synchronisation, the only one of the plan. ``on_device=False`` (the CPU
    backends, which need the counts on the host anyway) uses numpy's ``flatnonzero``. All three
    give the same pairs in the same order.
    """
    T, N = mask_TN.shape
    if on_device is None:
        on_device = mask_TN.device.type != "cpu"
    if not on_device:
        # numpy's flatnonzero on the expert-major copy is ~3x faster than torch.nonzero on CPU
        flat = torch.from_numpy(np.flatnonzero(mask_TN.t().contiguous().numpy()))
        expert_idx, token_idx = flat // max(T, 1), flat % max(T, 1)
        counts_N = torch.bincount(expert_idx, minlength=N)
        return Dispatch(token_idx, expert_idx, counts_N)
    mask_NT = mask_TN.t()
    if num_pairs is None:
        pairs = mask_NT.nonzero()  # [P, 2] as (expert, token), sorted by expert then token
    else:
        pairs = mask_NT.nonzero_static(size=num_pairs)
    expert_idx, token_idx = pairs.unbind(1)
    counts_N = mask_TN.sum(0)  # int64 [N] on the device (bincount would read max() back)
    return Dispatch(token_idx, expert_idx, counts_N)


def permute(x_TD: Tensor, d: Dispatch) -> Tensor:
    """Gather token rows into expert order: ``[T, D] -> [P, D]``."""
    return x_TD.index_select(0, d.token_idx_P)


def unpermute(y_PD: Tensor, weights_P: Tensor, d: Dispatch, num_tokens: int) -> Tensor:
    """Scale each pair's output by its gate and sum back per token: ``[P, D] -> [T, D]``.

    Tokens with no active pair receive exact zeros (the residual path carries them).
    """
    out = y_PD.new_zeros(num_tokens, y_PD.shape[1])
    return out.index_add_(0, d.token_idx_P, y_PD * weights_P.unsqueeze(1).to(y_PD.dtype))


def pair_gates(gates_TN: Tensor, d: Dispatch) -> Tensor:
    """``gates_TN[token_idx_P, expert_idx_P]`` through one flat ``index_select``."""
    flat_P = d.token_idx_P * gates_TN.shape[1] + d.expert_idx_P
    return gates_TN.reshape(-1).index_select(0, flat_P)


def block_layout(d: Dispatch, max_rows: int, pad_limit: float = 1.25, small_group: int = 96,
                 small_pad_limit: float = 2.0) -> BlockLayout:
    """Cut the experts into consecutive chunks of at most ``max_rows`` padded rows.

    Greedy: an expert joins the current chunk while ``(#experts) * max count <= max_rows``
    (a single expert larger than ``max_rows`` gets a chunk of its own). A chunk is padded when
    the padding stays below ``pad_limit`` x its pairs, or below ``small_pad_limit`` x when
    its mean group is under ``small_group`` rows (tiny groups: one ``bmm`` beats a loop of
    tiny matmuls even with padding); otherwise it is jagged.
    """
    counts = d.counts_N.tolist()
    N = len(counts)
    chunks: list[Chunk] = []
    row_start = [0] * N  # first row of each expert
    e0, m, r = 0, 0, 0

    def close(e1: int, m: int) -> None:
        nonlocal r
        if e1 == e0:
            return
        pairs = sum(counts[e0:e1])
        n = e1 - e0
        mean = pairs / n
        padded_rows = n * m
        use_pad = m > 0 and (padded_rows <= pad_limit * pairs
                             or (mean < small_group and padded_rows <= small_pad_limit * pairs))
        if use_pad:
            for i, e in enumerate(range(e0, e1)):
                row_start[e] = r + i * m
            rows = padded_rows
        else:
            acc = r
            for e in range(e0, e1):
                row_start[e] = acc
                acc += counts[e]
            rows = pairs
        chunks.append(Chunk(e0, e1, r, r + rows, m if use_pad else 0))
        r += rows

    for e, c in enumerate(counts):
        new_m = max(m, c)
        if e > e0 and (e - e0 + 1) * new_m > max_rows:
            close(e, m)
            e0, new_m = e, c
        m = new_m
    close(N, m)

    P = d.num_pairs
    device = d.token_idx_P.device
    pair_start = torch.zeros(N, dtype=torch.int64)
    if N > 1:
        pair_start[1:] = d.counts_N.cpu().cumsum(0)[:-1]
    shift_N = (torch.tensor(row_start, dtype=torch.int64) - pair_start).to(device)
    row_P = torch.arange(P, device=device) + shift_N[d.expert_idx_P]
    if r == P:
        tok_R = d.token_idx_P  # no padding anywhere: rows are the pairs
    else:
        tok_R = torch.zeros(r, dtype=torch.int64, device=device)
        tok_R[row_P] = d.token_idx_P
    return BlockLayout(tok_R, row_P, chunks, counts, r)
