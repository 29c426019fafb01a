"""Auxiliary-loss-free TopK (DeepSeek-V3): a per-expert bias steers selection, no LB loss.

Legend: T tokens, D model width, N experts (E*G), K active experts per token.

Selection ranks ``softmax(x W) + b`` (``b``: one bias per expert); the gates are the kept
probabilities WITHOUT the bias (the paper's eq. 2 gates, or renormalised to sum to 1 per token
with ``model.topk_normalize``), so the bias changes which experts a token uses, never how much
their outputs weigh. There is no load-balancing loss: after every optimizer step the trainer
hands each router the step's token counts per expert (summed over micro-batches and ranks, see
:meth:`Router.after_step`) and the bias moves against the load error, with the sign rule and
centring of torchtitan's ``load_balance_coeff``::

    delta_N = rate * sign(mean(load_N) - load_N);   b_N += delta_N - mean(delta_N)

``rate`` is ``model.bias_update_rate`` (1e-3, DeepSeek-V3's bias update speed and torchtitan's
default). ``b`` is a persistent fp32 buffer: it is saved with the model, restored on resume and
never touched by the optimizer. docs/BASELINES.md lists what differs from DeepSeek-V3.
"""

from __future__ import annotations

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, bias_update, zero
from remoe.model.routers.options import AuxFreeOptions
from remoe.model.routers.topk import topk_mask


class AuxFreeTopKRouter(Router):
    """TopK of ``softmax(x W) + expert_bias_N`` for selection; gates from the unbiased softmax."""

    options = AuxFreeOptions

    def __init__(self, d_model: int, num_experts: int, k: int, bias_update_rate: float = 1e-3,
                 init_std: float = 0.02, normalize: bool = False) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.k = k
        self.bias_update_rate = float(bias_update_rate)
        self.normalize = normalize
        self.register_buffer("expert_bias_N", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)

    @classmethod
    def from_config(cls, cfg) -> "AuxFreeTopKRouter":
        r, o = cfg.routing, cfg.options
        return cls(cfg.d_model, cfg.num_routed, r.num_active, o.bias_update_rate,
                   init_std=cfg.init_std, normalize=o.topk_normalize)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        probs_TN = torch.softmax(self.logits(x_TD), dim=-1)
        # the bias only ranks experts (no gradient through the choice, none into the bias)
        mask_TN = topk_mask(probs_TN.detach() + self.expert_bias_N.to(probs_TN.dtype), self.k)
        gates_TN = probs_TN * mask_TN
        if self.normalize:
            gates_TN = gates_TN / gates_TN.sum(dim=-1, keepdim=True)
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD), num_pairs=x_TD.shape[0] * self.k)

    @torch.no_grad()
    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """Move the bias by the step's load error (``counts_N``: tokens per expert, [N])."""
        if self.bias_update_rate == 0:
            return
        delta_N = bias_update(counts_N.detach().cpu(), self.bias_update_rate)
        self.expert_bias_N.add_(delta_N.to(self.expert_bias_N))
