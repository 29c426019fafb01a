"""ReLU routing held sparse by per-expert thresholds instead of an L1 penalty.

Legend: T tokens, D model width, N experts (E*G).

Gates ``ReLU(x W - theta_N)``: ``theta_N`` is one threshold per expert, a persistent fp32
buffer (saved with the model, restored on resume, never touched by the optimizer). There is no
regularisation term (``reg_loss = 0``, no lambda controller: the router does not declare
``uses_adaptive_reg``) and no auxiliary loss. After every optimizer step the trainer hands the
router its layer's tokens per expert ``c_N`` and the step's token count ``T``, both summed over
micro-batches and data-parallel ranks (:meth:`Router.after_step`; every rank sees
the same numbers, so every rank makes the same step), and each threshold moves in proportion to
its expert's relative load error, the load over its target ``k T / E`` (``k/E`` of the tokens,
for any G) minus one::

    theta_e += rate * (c_e / (k T / E) - 1)

An expert over its target raises its threshold, one under it lowers it. The step is not
centred: the thresholds do not sum to a constant, so their mean sets the layer's density
(1 - S) and each one sets its expert's share. ``rate`` is ``model.threshold_rate``. This is
``model.threshold_rule: load``, the default.

``model.threshold_rule: quantile`` also follows the logits: each threshold is the moving average
of its expert's capacity quantile of the logits (the logit that exactly ``k T / E`` of a
micro-batch's tokens exceed, :mod:`remoe.model.routers.thresholds`, as ``expert_threshold``
does with softmax scores; decay ``model.threshold_ema_decay``) plus an additive correction that
integrates the same load error::

    theta_N = qbar_N + u_N,   u_e += rate * (c_e / (k T / E) - 1)

Without a penalty the LM gradient moves each expert's logits as a whole, and the load rule's
integrator lags such a drift by ``drift / rate`` (it ran too dense over a long run,
docs/ROUTERS.md); the quantile moves with the logits, and the correction is left with the
one-step lag only. Its state (``quantile_N``, ``correction_N``, ``threshold_updates``) exists
only under this rule, so the default router's state dict is unchanged. Measured: it holds the
density but trains badly (without the L1 term the gates grow large; docs/ROUTERS.md), so it is
an option kept with its negative result, not a recommendation.

Why this rule (docs/ROUTERS.md): proportional to the error, it rests at the target (the sign
rule of ``topk_auxfree`` never does: it moves +-rate every step, a limit cycle whose amplitude
is set by the rate); linear in the load, its fixed point is a *mean* load equal to the target
even when the loads vary from step to step with the batch's content (a step in the log of the
load ratio settles where the mean log load is on target, i.e. the mean load above it: Jensen;
measured with lag included: 0.84 for a target of 0.875 on the study backbone); ``theta``
integrates the error, so a constant load error cannot persist; an expert with no token steps
down by ``rate`` every step until tokens clear its threshold again (no revival hinge needed).
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
            return cfg.num_experts * cfg.granularity / 2.0
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
