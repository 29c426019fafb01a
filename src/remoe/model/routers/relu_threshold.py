"""ReLU routing held sparse by per-expert thresholds instead of an L1 penalty.

Legend: T tokens, D model width, N experts (E*G).

Gates ``ReLU(x W - theta_N)``: ``theta_N`` is one threshold per expert, a persistent fp32
buffer (saved with the model, restored on resume, never touched by the optimizer). There is no
regularisation term (``reg_loss = 0``, no lambda controller: the router does not declare
``uses_adaptive_reg``) and no auxiliary loss. After every optimizer step
(:meth:`Router.after_step_with_tokens`) each threshold moves toward its expert's target load
``k T / E`` (``k/E`` of the tokens, for any G), from the step's tokens per expert ``c_N`` and
token count ``T`` (summed over micro-batches and data-parallel ranks) and the mean ``m_e`` and
standard deviation ``s_e`` of each expert's logits over the step's tokens (averaged over
micro-batches and ranks: one all-reduce of 2N+1 numbers per layer and step when distributed).
The threshold is kept as a place in its logits' distribution, ``u_e`` spreads above their
(EMA) mean, and that place is steered by the load error::

    u_e      = (theta_e - mbar_e) / sbar_e                  before this step's update
    mbar_e  <- decay * mbar_e + (1 - decay) * m_e           (m_e at the first update)
    sbar_e  <- decay * sbar_e + (1 - decay) * s_e           (s_e at the first update)
    theta_e  = mbar_e + sbar_e * (u_e + rate * (c_e / (k T / E) - 1))

An expert over its target raises its threshold, one under it lowers it; ``rate`` is
``model.threshold_rate`` (dimensionless), ``decay`` ``model.threshold_ema_decay``. The step is
not centred: the mean threshold sets the layer's density (1 - S), each one its expert's share.

Why (docs/ROUTERS.md): nothing pulls the gates down, so the LM gradient moves each expert's
logits as a whole, by up to half their spread in one step at the micro preset's learning rate
(measured: the mean logit rising 0.025-0.06 per step while the spread was 0.04-0.3, and the
spread itself growing 5x in 50 steps). A threshold moved only by the load error chases that
ramp and lags it by ``drift / gain``: the rule before this one, ``theta_e += 0.05 (c_e/(kT/E)
- 1)`` in logit units, ran at 1.3-1.5 times the target load in one layer of the micro study by
its end. Following the distribution's location and spread leaves the load error term a slowly
varying offset to integrate (a constant error cannot persist; the EMA's lag behind a steady
drift or growth is such an offset), and gives it the same loop gain for any logit scale: near
a Gaussian tail at 1 - k/E = 0.875, a step of ``u`` by 1 changes the load by ~1.65 times its
target, so ``rate`` (default 0.3) takes about half the error out per step and is stable below
~1.2. The EMA (default decay 0.9) keeps the batch-to-batch noise of the mean out of the
thresholds (measured: once the drift stops, the raw mean still jumps by ~0.2 of the spread
between batches, which fed straight into the thresholds swung the per-step sparsity by
+-0.03). The update is linear in the load error (its fixed point is a mean load on target; a
step in the log of the load ratio would settle on the mean *log* load: Jensen), and an expert
with no token steps down by ``rate`` spreads every step until tokens clear its threshold again
(no revival hinge needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from remoe.errors import ConfigError
from remoe.model.routers.base import Router, RouterContext, Routing, zero


@dataclass(frozen=True)
class ReLUThresholdOptions:
    """``model.threshold_rate``: a threshold's step per unit of relative load error, in units
    of the spread of its expert's logits; ``model.threshold_ema_decay``: the weight of the old
    location in the EMA of each expert's mean logit (0: each step's mean)."""

    threshold_rate: float = 0.3
    threshold_ema_decay: float = 0.9

    def validate(self, prefix: str = "model.") -> None:
        r, d = self.threshold_rate, self.threshold_ema_decay
        if not (math.isfinite(r) and r > 0):
            raise ConfigError(f"{prefix}threshold_rate={r!r} must be a finite number > 0")
        if not (math.isfinite(d) and 0.0 <= d < 1.0):
            raise ConfigError(f"{prefix}threshold_ema_decay={d!r} must be a number in [0, 1)")


TINY = 1e-6  # the smallest logit spread a threshold is measured in


def load_error(counts_N: Tensor, num_tokens: float, target_density: float) -> Tensor:
    """``c_e / (T k/E) - 1`` in fp64: > 0 for an expert over its target load."""
    target = float(num_tokens) * target_density
    return counts_N.detach().to(torch.float64) / target - 1.0


class ReLUThresholdRouter(Router):
    """Gates ``ReLU(x W - theta_N)`` with ``theta_N`` steered to each expert's target load."""

    options = ReLUThresholdOptions

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 threshold_rate: float = ReLUThresholdOptions.threshold_rate,
                 threshold_ema_decay: float = ReLUThresholdOptions.threshold_ema_decay,
                 init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.target_density = float(target_density)  # k/E
        self.threshold_rate = float(threshold_rate)
        self.decay = float(threshold_ema_decay)
        self.register_buffer("threshold_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)
        # the EMAs of each expert's logit mean and spread (the frame the threshold's place
        # u_e is measured in) and the number of updates made (0: no frame yet)
        self.register_buffer("logit_mean_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)
        self.register_buffer("logit_std_N", torch.ones(num_experts, dtype=torch.float32),
                             persistent=True)
        self.register_buffer("threshold_updates", torch.zeros((), dtype=torch.int64),
                             persistent=True)
        # this step's logit statistics: sums over micro-batches of [mean_N, std_N] and their
        # number, [2N + 1] fp64. A plain attribute: never saved, never broadcast by DDP
        self._pending: Tensor | None = None

    @classmethod
    def from_config(cls, cfg) -> "ReLUThresholdRouter":
        return cls(cfg.d_model, cfg.num_routed, cfg.target_density,
                   threshold_rate=cfg.options.threshold_rate,
                   threshold_ema_decay=cfg.options.threshold_ema_decay, init_std=cfg.init_std)

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        if step is not None and step < dense_steps:  # thresholds start at 0: half the experts
            return cfg.num_experts * cfg.granularity / 2.0
        return super().expected_pairs(cfg, step, dense_steps)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        logits_TN = self.logits(x_TD)
        if self.training and torch.is_grad_enabled() and logits_TN.shape[0] > 1:
            self._observe(logits_TN.detach())
        gates_TN = torch.relu(logits_TN - self.threshold_N.to(logits_TN.dtype))
        mask_TN = gates_TN > 0
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD))

    def _observe(self, logits_TN: Tensor) -> None:
        """Add one micro-batch's per-expert logit mean and std to the step's (a recomputed
        forward adds the same values again, which leaves their mean unchanged)."""
        z = logits_TN.to(torch.float64)
        row = torch.cat([z.mean(0), z.std(0), z.new_ones(1)])
        self._pending = row if self._pending is None else self._pending + row

    @torch.no_grad()
    def after_step_with_tokens(self, counts_N: Tensor, num_tokens: float | None) -> None:
        """Move each threshold with its logits' location and spread, and by ``rate`` spreads
        per unit of load error (module docstring; no-op without a training forward)."""
        if num_tokens is None:
            raise ValueError("relu_threshold needs the step's token count to update its "
                             "thresholds")
        pending, self._pending = self._pending, None
        n = self.num_experts
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if pending is None:  # every rank must join the collective
                pending = torch.zeros(2 * n + 1, dtype=torch.float64,
                                      device=self.threshold_N.device)
            dist.all_reduce(pending)
        if pending is None or num_tokens <= 0:
            return
        # on the buffers' device, with no host synchronisation (a step whose ranks made no
        # training forward has pending[-1] == 0: nothing changes)
        dev = self.threshold_N.device
        pending = pending.to(dev)
        fresh = pending[-1] > 0
        stats = pending[:-1] / pending[-1].clamp(min=1.0)
        mean_N, std_N = stats[:n], stats[n:]
        err_N = load_error(counts_N.to(dev), num_tokens, self.target_density)
        first = self.threshold_updates == 0  # no location yet: this step's
        old_mean_N = torch.where(first, mean_N, self.logit_mean_N.to(mean_N))
        old_std_N = torch.where(first, std_N, self.logit_std_N.to(std_N))
        mean_N = self.decay * old_mean_N + (1.0 - self.decay) * mean_N
        std_N = self.decay * old_std_N + (1.0 - self.decay) * std_N
        # the threshold's place in its logits' distribution, in spreads above their mean
        u_N = (self.threshold_N.to(mean_N) - old_mean_N) / old_std_N.clamp(min=TINY)
        u_N = u_N + self.threshold_rate * err_N
        theta_N = mean_N + std_N.clamp(min=TINY) * u_N
        for buf, new in ((self.threshold_N, theta_N), (self.logit_mean_N, mean_N),
                         (self.logit_std_N, std_N)):
            buf.copy_(torch.where(fresh, new.to(buf), buf))
        self.threshold_updates.add_(fresh.to(torch.int64))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, target_density={self.target_density}, "
                f"threshold_rate={self.threshold_rate}, threshold_ema_decay={self.decay}")
