"""Per-expert capacity quantiles and their moving average: the threshold machinery shared by
``expert_threshold`` (on softmax scores) and ``relu_threshold``'s ``quantile`` rule (on logits).

Legend: T tokens, N experts (E*G), C = round(T k/E) tokens per expert.

Each training forward measures, per expert, the value that exactly C of the micro-batch's tokens
exceed (:func:`capacity_quantile`); :class:`QuantileEMA` sums them over the step's micro-batches
and, after the optimizer step, averages them over the step (and the data-parallel ranks, one
all-reduce of N+1 numbers) and folds them into an exponential moving average::

    qbar_N <- q_N                                    at the first update
    qbar_N <- decay * qbar_N + (1 - decay) * q_N     after it

Not a router: a mixin for one. The router registers the persistent buffers ``quantile_N``
(fp32, its starting value the router's choice) and ``threshold_updates`` (int64), sets
``self.decay`` and ``self._pending = None`` (this step's sum, never saved), and calls
:meth:`QuantileEMA._observe` in its forward and :meth:`QuantileEMA._fold_quantiles` in its
``after_step``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor


def capacity_quantile(values_TN: Tensor, target_density: float) -> Tensor:
    """Per expert, a value that exactly ``C = round(T k/E)`` (clamped to [1, T-1]) of its tokens
    exceed: the midpoint of its C-th and (C+1)-th largest values ([N], no gradient)."""
    T = values_TN.shape[0]
    c = max(1, min(T - 1, math.floor(T * target_density + 0.5)))
    top_CN = values_TN.detach().topk(c + 1, dim=0).values
    return 0.5 * (top_CN[c - 1] + top_CN[c])


class QuantileEMA:
    """The step's mean capacity quantile folded into the EMA ``quantile_N`` (module docstring)."""

    num_experts: int
    quantile_N: Tensor
    threshold_updates: Tensor
    decay: float
    _pending: Tensor | None

    def _observe(self, q_N: Tensor) -> None:
        """Add one micro-batch's quantiles to the step's (a recomputed forward adds the same
        values again, which leaves their mean unchanged)."""
        row = torch.cat([q_N.to(torch.float64), q_N.new_ones(1, dtype=torch.float64)])
        self._pending = row if self._pending is None else self._pending + row

    def discard_step(self) -> None:
        """The step is redone: its forwards' quantiles are dropped (they come again)."""
        self._pending = None

    def _fold_quantiles(self) -> None:
        """Fold the step's mean quantile into the EMA (no-op if the step had no training
        forward)."""
        pending, self._pending = self._pending, None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if pending is None:  # every rank must join the collective
                pending = torch.zeros(self.num_experts + 1, dtype=torch.float64,
                                      device=self.quantile_N.device)
            dist.all_reduce(pending)
        if pending is None:
            return
        q_N = (pending[:-1] / pending[-1].clamp(min=1.0)).to(self.quantile_N)
        first = self.threshold_updates == 0
        ema_N = self.decay * self.quantile_N + (1.0 - self.decay) * q_N
        fresh = (pending[-1] > 0).to(self.quantile_N.device)
        self.quantile_N.copy_(torch.where(fresh, torch.where(first, q_N, ema_N), self.quantile_N))
        self.threshold_updates.add_(fresh.to(torch.int64))
