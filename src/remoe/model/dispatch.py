"""Permute / unpermute primitives between token order and expert order.

Legend: T tokens, D model width, N experts, P active (token, expert) pairs.
Only active pairs are ever materialised, so the cost follows P, not T*N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Dispatch:
    """Where each active (token, expert) pair lives once sorted by expert."""

    token_idx_P: Tensor  # int64 [P]: source token of each pair, grouped by expert
    expert_idx_P: Tensor  # int64 [P]: expert of each pair (non-decreasing)
    counts_N: Tensor  # int64 [N]: pairs per expert (tokens routed to it)

    @property
    def num_pairs(self) -> int:
        return self.token_idx_P.numel()


def plan(mask_TN: Tensor) -> Dispatch:
    """Group the active pairs of a boolean ``[T, N]`` mask by expert (tokens ascending inside)."""
    pairs = mask_TN.t().nonzero()  # [P, 2] as (expert, token), sorted by expert then token
    expert_idx, token_idx = pairs.unbind(1)
    counts_N = torch.bincount(expert_idx, minlength=mask_TN.shape[1])
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
