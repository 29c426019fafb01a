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
(1 - S) and each one sets its expert's share. ``rate`` is ``model.threshold_rate``.

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


@dataclass(frozen=True)
class ReLUThresholdOptions:
    """``model.threshold_rate``: a threshold's step per unit of relative load error."""

    threshold_rate: float = 0.05

    def validate(self, prefix: str = "model.") -> None:
        r = self.threshold_rate
        if not (math.isfinite(r) and r > 0):
            raise ConfigError(f"{prefix}threshold_rate={r!r} must be a finite number > 0")


def load_error(counts_N: Tensor, num_tokens: float, target_density: float) -> Tensor:
    """``c_e / (T k/E) - 1`` in fp64: > 0 for an expert over its target load."""
    target = float(num_tokens) * target_density
    return counts_N.detach().to(torch.float64) / target - 1.0


class ReLUThresholdRouter(Router):
    """Gates ``ReLU(x W - theta_N)`` with ``theta_N`` steered to each expert's target load."""

    options = ReLUThresholdOptions

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 threshold_rate: float = ReLUThresholdOptions.threshold_rate,
                 init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.target_density = float(target_density)  # k/E
        self.threshold_rate = float(threshold_rate)
        self.register_buffer("threshold_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)

    @classmethod
    def from_config(cls, cfg) -> "ReLUThresholdRouter":
        return cls(cfg.d_model, cfg.num_routed, cfg.target_density,
                   threshold_rate=cfg.options.threshold_rate, init_std=cfg.init_std)

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        if step is not None and step < dense_steps:  # thresholds start at 0: half the experts
            return cfg.num_experts * cfg.granularity / 2.0
        return super().expected_pairs(cfg, step, dense_steps)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        logits_TN = self.logits(x_TD)
        gates_TN = torch.relu(logits_TN - self.threshold_N.to(logits_TN.dtype))
        mask_TN = gates_TN > 0
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD))

    @torch.no_grad()
    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """Move each threshold by ``rate * (c_e / (k T / E) - 1)``."""
        if num_tokens is None:
            raise ValueError("relu_threshold needs the step's token count to update its "
                             "thresholds")
        if num_tokens <= 0:
            return
        step_N = self.threshold_rate * load_error(counts_N.cpu(), num_tokens, self.target_density)
        self.threshold_N.add_(step_N.to(self.threshold_N))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, target_density={self.target_density}, "
                f"threshold_rate={self.threshold_rate}")
