"""Expert Threshold routing (Sun et al. 2026, arXiv 2603.11535), adapted to the Routing contract.

Legend: T tokens, D model width, N experts (E*G), C = round(T k/E) tokens per expert.

Each expert keeps a threshold on its own score distribution, an exponential moving average of
the score that its target share of tokens (``k/E``, Expert Choice's capacity) clears; a token
goes to every expert whose score clears that expert's threshold, so a token uses 0..N experts.
The thresholds come from past steps only: routing is causal (no token's route depends on
another token of the batch, in training as at inference) and there is no auxiliary loss::

    s_TN = softmax(x W)                  scores, as in Expert Choice (which ET makes causal)
    mask_TN = s_TN > theta_N             theta_N: the thresholds before this step
    gates_TN = s_TN * mask_TN            the score is the gate (gradient to W through it)
    theta_N = qbar_N * exp(u_N)          qbar: the EMA quantile; u: the load correction

After every optimizer step (:meth:`Router.after_step`), the step's quantile ``q_N`` joins the
average (:mod:`remoe.model.routers.thresholds`, shared with ``relu_threshold``): ``q_e`` is the
midpoint of the C-th and (C+1)-th largest score of expert e in a micro-batch (exactly C of its
tokens clear it), averaged over the step's micro-batches and the data-parallel ranks (one
all-reduce of N+1 numbers per layer and step when distributed)::

    qbar_N <- q_N                                    at the first update
    qbar_N <- decay * qbar_N + (1 - decay) * q_N     after it

``decay`` is ``model.threshold_ema_decay``; before the first update ``qbar`` is ``1/N`` (the
score of a uniform router).

The load correction ``u_e += rate * (c_e / (k T / E) - 1)`` (``model.threshold_rate``; 0
gives the EMA quantiles alone) is this codebase's addition: it integrates the step's relative
load error from the all-reduced counts, multiplicatively (scores are positive and their scale
changes as the router sharpens). ``qbar_N``, ``u_N`` (fp32) and the update count (int64) are
persistent buffers: saved with the model, restored on resume. Why the correction (the EMA
quantiles alone ran too dense at these learning rates), what was measured and what else is
adapted from the paper: docs/ROUTERS.md, "Penalty-free sparsity control".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from remoe.errors import ConfigError
from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.thresholds import QuantileEMA, capacity_quantile


@dataclass(frozen=True)
class ExpertThresholdOptions:
    """``model.threshold_ema_decay``: the weight of the old quantile in each EMA update;
    ``model.threshold_rate``: the step of each threshold's log correction per unit of relative
    load error (0: the thresholds are the EMA quantiles alone, as published)."""

    threshold_ema_decay: float = 0.9
    threshold_rate: float = 0.05

    def validate(self, prefix: str = "model.") -> None:
        d, r = self.threshold_ema_decay, self.threshold_rate
        if not (math.isfinite(d) and 0.0 <= d < 1.0):
            raise ConfigError(f"{prefix}threshold_ema_decay={d!r} must be a number in [0, 1)")
        if not (math.isfinite(r) and r >= 0.0):
            raise ConfigError(f"{prefix}threshold_rate={r!r} must be a finite number >= 0 "
                              "(0: no load correction)")


class ExpertThresholdRouter(QuantileEMA, Router):
    """``softmax(x W)`` kept where it clears each expert's threshold (module docstring)."""

    options = ExpertThresholdOptions

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 threshold_ema_decay: float = ExpertThresholdOptions.threshold_ema_decay,
                 threshold_rate: float = ExpertThresholdOptions.threshold_rate,
                 init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.target_density = float(target_density)  # k/E
        self.decay = float(threshold_ema_decay)
        self.threshold_rate = float(threshold_rate)
        # the EMA of each expert's capacity quantile (1/N, a uniform router's score, at first)
        self.register_buffer("quantile_N", torch.full((num_experts,), 1.0 / num_experts,
                                                      dtype=torch.float32), persistent=True)
        # the log correction u_N moved by the realised loads (0 with threshold_rate = 0)
        self.register_buffer("correction_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)
        self.register_buffer("threshold_updates", torch.zeros((), dtype=torch.int64),
                             persistent=True)
        # this step's quantiles: sum over micro-batches and their number, [N + 1] fp64. A plain
        # attribute, not a buffer: never saved (empty between steps) and never broadcast by DDP
        self._pending: Tensor | None = None

    @classmethod
    def from_config(cls, cfg) -> "ExpertThresholdRouter":
        return cls(cfg.d_model, cfg.num_routed, cfg.target_density,
                   threshold_ema_decay=cfg.options.threshold_ema_decay,
                   threshold_rate=cfg.options.threshold_rate, init_std=cfg.init_std)

    @property
    def threshold_N(self) -> Tensor:
        """theta_N = EMA quantile * exp(u_N), fp32."""
        return self.quantile_N * torch.exp(self.correction_N)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        scores_TN = torch.softmax(self.logits(x_TD), dim=-1)
        if self.training and torch.is_grad_enabled() and scores_TN.shape[0] > 1:
            self._observe(capacity_quantile(scores_TN, self.target_density))
        mask_TN = scores_TN > self.threshold_N.to(scores_TN.dtype)
        gates_TN = scores_TN * mask_TN
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD))

    @torch.no_grad()
    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """The EMA update (:meth:`_fold_quantiles`), then the load correction
        ``u_e += rate * (c_e / (k T / E) - 1)`` (skipped without a token count)."""
        self._fold_quantiles()
        if self.threshold_rate > 0 and num_tokens:
            err_N = counts_N.detach().cpu().to(torch.float64) / (num_tokens * self.target_density)
            self.correction_N.add_((self.threshold_rate * (err_N - 1.0)).to(self.correction_N))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, target_density={self.target_density}, "
                f"threshold_ema_decay={self.decay}, threshold_rate={self.threshold_rate}")
