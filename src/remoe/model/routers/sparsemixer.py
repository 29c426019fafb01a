"""SparseMixer-v2 (GRIN; Liu et al., 2024, "GRIN: GRadient-INformed MoE").

Legend: T tokens, D model width, N experts (E*G), K = k*G experts picked per token.

TopK routing whose discrete expert choice gets a gradient estimate instead of the plain
"straight" TopK gradient (which only flows through the softmax value of the kept experts).
Per token, with router logits ``z = x W`` (fp32), K experts are picked one after the other; the
j-th pick (GRIN's top-2 recipe applied K times) is:

1. **Jitter mask.** With ``m`` the largest logit among experts not yet picked, an expert ``i``
   stays eligible iff ``(m - z_i) / max(|z_i|, m) <= 2 * eps`` (``eps`` =
   ``sparsemixer_jitter``, 0.01 in GRIN / Phi-3.5-MoE). Picked experts and all others are masked.
2. **Masked softmax.** ``pi = softmax(z over the eligible experts)`` (0 elsewhere).
3. **Choice.** Training (``module.training``): sample ``D ~ pi`` (Gumbel-max). Inference: the
   arg-max (the same experts as TopK).
4. **Gate.** Inference: ``g = pi_D``. Training: ``g = pi_D * s`` where ``s = 1`` if ``D`` is the
   arg-max of ``pi`` and otherwise ``s = 1`` with probability 1/4 and ``1/3`` with probability
   3/4 -- the forward half of the third-order Heun-type midpoint rule GRIN uses
   (``f(x) - f(0) ~ 1/4 f'(x) + 3/4 f'(x/3)``). The backward is GRIN's estimator:
   ``d g / d z = pi_D (e_D - pi)`` (the masked-softmax derivative of the *unscaled* ``pi_D``), so
   the router weights receive this gradient, not the straight TopK one nor autograd's (which
   would carry the factor ``s`` and the full, unmasked softmax).

Gates are not renormalised. The Switch load-balancing loss (``lb_coeff`` x ``N sum_e f_e P_e``,
P from the full softmax, f from the picked experts) is added exactly as for TopK. GRIN's
separate multiplicative input jitter (``input_jitter_noise`` of Phi-3.5-MoE) is not part of
the estimator and is not implemented.
"""

from __future__ import annotations

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.options import SparseMixerOptions
from remoe.model.routers.topk import switch_load_balancing_loss

#: GRIN's midpoint rule: a sampled non-arg-max expert keeps its full gate with this probability.
FULL_GATE_PROB = 0.25
MIDPOINT_SCALE = 1.0 / 3.0


class _EstimatedGate(torch.autograd.Function):
    """``g = pi[D] * s`` in forward; ``dg/dz = pi[D] (onehot(D) - pi)`` in backward."""

    @staticmethod
    def forward(ctx, logits_TN: Tensor, pi_TN: Tensor, choice_T1: Tensor, scale_T1: Tensor) -> Tensor:
        pi_sel_T1 = pi_TN.gather(1, choice_T1)
        ctx.save_for_backward(pi_TN, choice_T1, pi_sel_T1)
        return pi_sel_T1 * scale_T1

    @staticmethod
    def backward(ctx, grad_T1: Tensor):
        pi_TN, choice_T1, pi_sel_T1 = ctx.saved_tensors
        w_T1 = grad_T1 * pi_sel_T1
        grad_TN = -pi_TN * w_T1
        grad_TN.scatter_add_(1, choice_T1, w_T1)
        return grad_TN, None, None, None


def eligible_mask(logits_TN: Tensor, taken_TN: Tensor, eps: float) -> Tensor:
    """Experts within ``2 eps`` (relative) of the best untaken logit, excluding taken ones."""
    free_TN = logits_TN.masked_fill(taken_TN, float("-inf"))
    m_T1 = free_TN.max(dim=-1, keepdim=True).values
    scale_TN = logits_TN.abs().clamp(min=m_T1)
    too_far_TN = (m_T1 - logits_TN) / scale_TN > 2 * eps  # NaN (0/0 at z = m = 0) stays eligible
    return ~too_far_TN & ~taken_TN


def sparsemixer_route(logits_TN: Tensor, k: int, eps: float, training: bool) -> tuple[Tensor, Tensor]:
    """``(gates_TN, mask_TN)``: K sequential SparseMixer-v2 picks per token (see module doc)."""
    T, N = logits_TN.shape
    taken_TN = torch.zeros(T, N, dtype=torch.bool, device=logits_TN.device)
    gates = []
    choices = []
    for _ in range(k):
        with torch.no_grad():
            ok_TN = eligible_mask(logits_TN, taken_TN, eps)
            masked_TN = logits_TN.detach().masked_fill(~ok_TN, float("-inf"))
            pi_TN = torch.softmax(masked_TN, dim=-1)
            argmax_T1 = pi_TN.argmax(dim=-1, keepdim=True)
            if training:
                gumbel_TN = -torch.empty_like(masked_TN).exponential_().log()
                choice_T1 = (masked_TN + gumbel_TN).argmax(dim=-1, keepdim=True)
                keep_full_T1 = (choice_T1 == argmax_T1) | (torch.rand_like(pi_TN[:, :1]) < FULL_GATE_PROB)
                scale_T1 = torch.where(keep_full_T1, 1.0, MIDPOINT_SCALE).to(pi_TN.dtype)
            else:
                choice_T1 = argmax_T1
                scale_T1 = torch.ones_like(pi_TN[:, :1])
        if torch.is_grad_enabled() and logits_TN.requires_grad:
            gate_T1 = _EstimatedGate.apply(logits_TN, pi_TN, choice_T1, scale_T1)
        else:
            gate_T1 = pi_TN.gather(1, choice_T1) * scale_T1
        gates.append(gate_T1)
        choices.append(choice_T1)
        taken_TN = taken_TN.scatter(1, choice_T1, True)
    idx_TK = torch.cat(choices, dim=1)
    gates_TN = logits_TN.new_zeros(T, N).scatter(1, idx_TK, torch.cat(gates, dim=1))
    return gates_TN, taken_TN


class SparseMixerRouter(Router):
    """TopK routing with GRIN's SparseMixer-v2 gradient estimator and the Switch LB loss."""

    options = SparseMixerOptions

    def __init__(self, d_model: int, num_experts: int, k: int, lb_coeff: float = 0.01,
                 jitter_eps: float = 0.01, init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        if not 0 <= jitter_eps < 1:
            raise ValueError(f"sparsemixer_jitter={jitter_eps} must be in [0, 1)")
        self.k = k
        self.lb_coeff = lb_coeff
        self.jitter_eps = float(jitter_eps)

    @classmethod
    def from_config(cls, cfg) -> "SparseMixerRouter":
        r, o = cfg.routing, cfg.options
        return cls(cfg.d_model, cfg.num_routed, r.num_active,
                   o.lb_coeff, o.sparsemixer_jitter, init_std=cfg.init_std)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        logits_TN = self.logits(x_TD)
        gates_TN, mask_TN = sparsemixer_route(logits_TN, self.k, self.jitter_eps, self.training)
        aux = zero(x_TD)
        if self.lb_coeff:
            aux = self.lb_coeff * switch_load_balancing_loss(torch.softmax(logits_TN, dim=-1), mask_TN)
        return Routing(gates_TN, mask_TN, zero(x_TD), aux, num_pairs=x_TD.shape[0] * self.k)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, k={self.k}, jitter_eps={self.jitter_eps}"
