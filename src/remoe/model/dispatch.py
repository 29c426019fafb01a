"""Permute / unpermute primitives between token order and expert order.

Legend: T tokens, D model width, N experts, P active (token, expert) pairs (or, in a padded
plan, the static capacity C >= P), R rows of a blocked layout (P plus padding).
Only active pairs are ever materialised, so the cost follows P, not T*N (a padded plan: C).

Two consumers:

* the unfused backends (``reference``, ``grouped_mm``) use :func:`permute` / :func:`unpermute`
  on a jagged ``[P, D]`` copy of the inputs;
* the fused CPU backend (:mod:`remoe.model.fused_cpu`) never materialises ``[P, D]``: it walks
  its own row layout of the same plan (cache-sized chunks of experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass
class Dispatch:
    """Where each active (token, expert) pair lives once sorted by expert."""

    token_idx_P: Tensor  # int64 [P]: source token of each pair, grouped by expert
    expert_idx_P: Tensor  # int64 [P]: expert of each pair (non-decreasing)
    counts_N: Tensor  # int64 [N]: pairs per expert (tokens routed to it)
    #: bool [C] of a padded plan (:func:`plan` with ``capacity``): True on the first
    #: ``counts_N.sum()`` rows, the real pairs; the rest are padding rows that point at
    #: (token 0, expert 0) and must be masked (:func:`mask_padding`). None: no padding.
    valid_P: Tensor | None = None
    #: int64 [N] of a padded plan: the rows each expert holds in it -- ``counts_N`` unless the
    #: capacity cut the pairs of the last experts (then they sum to the capacity). What the
    #: expert GEMMs read; None: ``counts_N``
    rows_N: Tensor | None = None
    #: 0-d float of a padded plan: 1 when its pairs did not fit the capacity (then the plan
    #: holds the first ``capacity`` pairs and the layer's output is not exact), else 0
    overflow: Tensor | None = None
    #: per-plan cache of the fused CPU kernel's row layouts (remoe.model.fused_cpu)
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def num_pairs(self) -> int:
        return self.token_idx_P.numel()

    @property
    def row_counts_N(self) -> Tensor:
        """Rows per expert in the plan's layout (what grouped GEMMs take as group sizes)."""
        return self.counts_N if self.rows_N is None else self.rows_N


def plan(mask_TN: Tensor, num_pairs: int | None = None, on_device: bool | None = None,
         capacity: int | None = None) -> Dispatch:
    """Group the active pairs of a boolean ``[T, N]`` mask by expert (tokens ascending inside).

    ``on_device`` (default: the mask is not on the CPU) keeps the plan on the mask's device
    without a host synchronisation:

    * ``num_pairs`` known on the host (fixed-k routers: ``Routing.num_pairs``):
      ``nonzero_static`` of exactly that size, counts by a column sum;
    * else with ``capacity`` (a bound on the pairs: ``T * N``, or a smaller one from the previous
      step's counts): a *padded* plan of ``capacity`` rows -- the real pairs first, then
      padding rows at (token 0, expert 0) -- with ``valid_P`` marking the real ones. Its shapes
      do not depend on the routing, so a compiled block does not recompile when it changes.
      Pairs past the capacity are cut (``rows_N`` then stops at it, so no GEMM reads past the
      plan) and ``overflow`` says so: the caller redoes the step with a larger capacity;
    * else ``nonzero`` reads the pair count back: one synchronisation.

    ``on_device=False`` (the CPU backends, which need the counts on the host anyway) uses
    numpy's ``flatnonzero``. All give the same pairs in the same order.
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
    counts_N = mask_TN.sum(0)  # int64 [N] on the device (bincount would read max() back)
    valid_C = rows_N = overflow = None
    if num_pairs is not None:
        pairs = mask_NT.nonzero_static(size=num_pairs)
    elif capacity is not None:
        pairs = mask_NT.nonzero_static(size=capacity, fill_value=0)
        total = counts_N.sum()
        valid_C = torch.arange(capacity, device=mask_TN.device) < total
        ends_N = counts_N.cumsum(0).clamp(max=capacity)  # the last experts' rows cut at C
        rows_N = torch.diff(ends_N, prepend=ends_N.new_zeros(1))
        overflow = (total > capacity).float()
    else:
        pairs = mask_NT.nonzero()  # [P, 2] as (expert, token), sorted by expert then token
    expert_idx, token_idx = pairs.unbind(1)
    return Dispatch(token_idx, expert_idx, counts_N, valid_C, rows_N, overflow)


def mask_padding(rows_PK: Tensor, d: Dispatch) -> Tensor:
    """Zero the padding rows of a padded plan (identity without padding).

    ``grouped_mm`` leaves the rows past the last offset unwritten (garbage, NaN included), in
    its output and in its backward's input gradient alike; ``where`` keeps them out of both
    directions: the forward passes zeros on, the backward passes a zero gradient back."""
    if d.valid_P is None:
        return rows_PK
    return torch.where(d.valid_P.unsqueeze(1), rows_PK, rows_PK.new_zeros(()))


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
