"""ReLU routing held sparse by per-expert thresholds instead of an L1 penalty.

Legend: T tokens, D model width, N experts (E*G).

Gates ``ReLU(x W - theta_N)``, ``theta_N`` one threshold per expert: a persistent fp32 buffer
(saved with the model, restored on resume, never touched by the optimizer). No regularisation
term (no lambda controller: the router does not declare ``uses_adaptive_reg``) and no
auxiliary loss. After every optimizer step (:meth:`Router.after_step`) each threshold moves in
proportion to its expert's relative load error, from the step's tokens per expert ``c_N`` and
token count ``T`` (summed over micro-batches and data-parallel ranks: every rank makes the same
step)::

    theta_e += rate * (c_e / (k T / E) - 1)                  threshold_rule: load (default)
    theta_N = qbar_N + u_N,   u_e += rate * (c_e / (k T / E) - 1)     threshold_rule: quantile

``rate`` is ``model.threshold_rate``. Under ``quantile``, ``qbar_N`` is the moving average
(``model.threshold_ema_decay``) of each expert's capacity quantile of the logits
(:mod:`remoe.model.routers.thresholds`); its state (``quantile_N``, ``correction_N``,
``threshold_updates``) exists only under that rule, so a ``load`` model's state dict is
unchanged. Why this rule, and what was measured (``load`` runs too dense, ``quantile`` holds the
density but trains badly: kept as a negative result): docs/ROUTERS.md, "Penalty-free sparsity
control".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from remoe.errors import ConfigError
from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.thresholds import QuantileEMA, capacity_quantile

THRESHOLD_RULES = ("load", "quantile")


@dataclass(frozen=True)
class ReLUThresholdOptions:
    """``model.threshold_rate``: a threshold's step per unit of relative load error;
    ``model.threshold_rule``: ``load`` (the load error alone) or ``quantile`` (the EMA of the
    logits' capacity quantile plus that correction); ``model.threshold_ema_decay``: the old
    quantile's weight in each EMA update (``quantile`` only)."""

    threshold_rate: float = 0.05
    threshold_rule: str = "load"
    threshold_ema_decay: float = 0.9

    def validate(self, prefix: str = "model.") -> None:
        r, d = self.threshold_rate, self.threshold_ema_decay
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ConfigError(f"{prefix}threshold_rate={r!r} must be a finite number > 0")
        if self.threshold_rule not in THRESHOLD_RULES:
            raise ConfigError(f"{prefix}threshold_rule={self.threshold_rule!r} must be one of "
                              f"{', '.join(THRESHOLD_RULES)}")
        if not (isinstance(d, (int, float)) and math.isfinite(d) and 0.0 <= d < 1.0):
            raise ConfigError(f"{prefix}threshold_ema_decay={d!r} must be a number in [0, 1)")


def load_error(counts_N: Tensor, num_tokens: float, target_density: float) -> Tensor:
    """``c_e / (T k/E) - 1`` in fp64: > 0 for an expert over its target load."""
    target = float(num_tokens) * target_density
    return counts_N.detach().to(torch.float64) / target - 1.0


class ReLUThresholdRouter(QuantileEMA, Router):
    """Gates ``ReLU(x W - theta_N)`` with ``theta_N`` steered to each expert's target load."""

    options = ReLUThresholdOptions

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 threshold_rate: float = ReLUThresholdOptions.threshold_rate,
                 init_std: float = 0.02,
                 threshold_rule: str = ReLUThresholdOptions.threshold_rule,
                 threshold_ema_decay: float = ReLUThresholdOptions.threshold_ema_decay) -> None:
        super().__init__(d_model, num_experts, init_std)
        if threshold_rule not in THRESHOLD_RULES:
            raise ValueError(f"threshold_rule={threshold_rule!r} must be one of {THRESHOLD_RULES}")
        self.target_density = float(target_density)  # k/E
        self.threshold_rate = float(threshold_rate)
        self.rule = threshold_rule
        self.register_buffer("threshold_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)
        if self.rule == "quantile":  # the load rule's state dict stays threshold_N alone
            self.decay = float(threshold_ema_decay)
            # the EMA of each expert's capacity quantile of the logits (0, as theta, at first)
            self.register_buffer("quantile_N", torch.zeros(num_experts, dtype=torch.float32),
                                 persistent=True)
            self.register_buffer("correction_N", torch.zeros(num_experts, dtype=torch.float32),
                                 persistent=True)
            self.register_buffer("threshold_updates", torch.zeros((), dtype=torch.int64),
                                 persistent=True)
            self._pending: Tensor | None = None  # this step's quantiles (never saved)

    @classmethod
    def from_config(cls, cfg) -> "ReLUThresholdRouter":
        o = cfg.options
        return cls(cfg.d_model, cfg.num_routed, cfg.target_density,
                   threshold_rate=o.threshold_rate, init_std=cfg.init_std,
                   threshold_rule=o.threshold_rule, threshold_ema_decay=o.threshold_ema_decay)

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        if step is not None and step < dense_steps:  # thresholds start at 0: half the experts
            return cfg.num_routed / 2.0
        return super().expected_pairs(cfg, step, dense_steps)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        logits_TN = self.logits(x_TD)
        if (self.rule == "quantile" and self.training and torch.is_grad_enabled()
                and logits_TN.shape[0] > 1):
            self._observe(capacity_quantile(logits_TN, self.target_density))
        gates_TN = torch.relu(logits_TN - self.threshold_N.to(logits_TN.dtype))
        mask_TN = gates_TN > 0
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD))

    @torch.no_grad()
    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """Move each threshold by ``rate * (c_e / (k T / E) - 1)`` (``load``), or fold the
        step's quantiles into their EMA and move the correction by that much (``quantile``)."""
        if num_tokens is None:
            raise ValueError("relu_threshold needs the step's token count to update its "
                             "thresholds")
        if self.rule == "quantile":
            self._fold_quantiles()  # every rank joins its all-reduce, whatever the count
            if num_tokens > 0:
                err_N = load_error(counts_N.cpu(), num_tokens, self.target_density)
                self.correction_N.add_((self.threshold_rate * err_N).to(self.correction_N))
            self.threshold_N.copy_(self.quantile_N + self.correction_N)
            return
        if num_tokens <= 0:
            return
        step_N = self.threshold_rate * load_error(counts_N.cpu(), num_tokens, self.target_density)
        self.threshold_N.add_(step_N.to(self.threshold_N))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, target_density={self.target_density}, "
                f"threshold_rate={self.threshold_rate}, threshold_rule={self.rule}")
