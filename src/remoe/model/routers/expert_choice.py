"""Expert-Choice routing (Zhou et al., 2022, "Mixture-of-Experts with Expert Choice Routing").

Legend: T tokens, D model width, N experts (E*G), K = k*G, C per-expert capacity.

Instead of each token choosing its top-k experts, each *expert* chooses its top-C tokens:

    S = Softmax(x W)                 [T, N], softmax over experts (token-to-expert affinity)
    I = TopK(S^T, C) along tokens    each expert keeps the C tokens with the largest score
    gates = S on the chosen (token, expert) pairs, 0 elsewhere

with ``C = round(T * K / N * capacity_factor) = round(T * k / E * capacity_factor)`` (Zhou et al.'s
``k = n c / e`` with ``c = k * capacity_factor`` experts per token on average), clamped to
``[1, T]``. ``T`` is every token of the forward call (the whole micro-batch). Every expert
processes exactly C tokens (perfect load balance by construction, so there is no auxiliary
loss); a token may be chosen by 0..N experts (0 = only the residual path carries it). The
optional capped variant of the EC paper (a linear program bounding experts per token) is not
implemented.

Causality. Selecting over all tokens of the batch lets a later token (or another sequence)
change whether an earlier token is chosen: the training forward of a causal LM is *not*
causal under Expert-Choice. This is inherent to the method as published and is kept as is in
training and in full-sequence evaluation (the validation loss and log-likelihood scoring use the
same batch-level selection the model was trained with, as the paper's comparison does).

Decoding. A KV-cache decoding step has one new position per sequence (``ctx.seq_len == 1`` with
``ctx.step is None``): there is no set of tokens to choose from, so the router falls back to
token choice on the same scores, ``TopK(S, K)`` per token with gates = S (``generate()`` then
works and each generated token uses K experts). A full-sequence prefill (seq_len > 1) still uses
expert choice over the prompt tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.options import ExpertChoiceOptions
from remoe.model.routers.topk import topk_mask


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Tokens each expert takes: ``round(T * K / N * capacity_factor)`` clamped to ``[1, T]``."""
    if num_tokens == 0:
        return 0
    c = math.floor(num_tokens * k * capacity_factor / num_experts + 0.5)  # round half up
    return max(1, min(num_tokens, c))


class ExpertChoiceRouter(Router):
    """Each expert picks its top-C tokens by softmax score (see the module docstring)."""

    options = ExpertChoiceOptions

    def __init__(self, d_model: int, num_experts: int, k: int, capacity_factor: float = 1.0,
                 init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
        self.k = k
        self.capacity_factor = float(capacity_factor)

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        return float(cfg.num_active * cfg.options.capacity_factor)  # each expert's capacity

    @classmethod
    def from_config(cls, cfg) -> "ExpertChoiceRouter":
        r = cfg.routing
        return cls(cfg.d_model, cfg.num_routed, r.num_active,
                   cfg.options.capacity_factor, init_std=cfg.init_std)

    @property
    def active_experts_per_token(self) -> float:
        """Mean experts per token (N*C/T ~ K * capacity_factor), for active-parameter counts."""
        return min(float(self.num_experts), self.k * self.capacity_factor)

    def capacity(self, num_tokens: int) -> int:
        return expert_capacity(num_tokens, self.num_experts, self.k, self.capacity_factor)

    @staticmethod
    def is_decoding_step(ctx: RouterContext) -> bool:
        """One new position per sequence at inference: the token-choice fallback applies."""
        return ctx.step is None and ctx.seq_len == 1

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        scores_TN = torch.softmax(self.logits(x_TD), dim=-1)
        T = scores_TN.shape[0]
        if self.is_decoding_step(ctx):
            mask_TN = topk_mask(scores_TN, self.k)
            pairs = T * self.k
        else:
            mask_TN = torch.zeros_like(scores_TN, dtype=torch.bool)
            C = self.capacity(T)
            if C > 0:
                idx_CN = scores_TN.topk(C, dim=0).indices  # each column: the expert's C tokens
                mask_TN.scatter_(0, idx_CN, True)
            pairs = max(C, 0) * self.num_experts
        gates_TN = scores_TN * mask_TN
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD), num_pairs=pairs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, k={self.k}, capacity_factor={self.capacity_factor}"
