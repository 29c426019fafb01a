"""ReMoE's ReLU router: ``R = ReLU(x W)`` with the (load-balanced) L1 regulariser.

Legend: T tokens, D model width, N experts (E*G).
"""

from __future__ import annotations

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, zero


def l1_regularizer(gates_TN: Tensor, mask_TN: Tensor, target_density: float,
                   load_balance: bool = True) -> Tensor:
    """One layer's term of paper eq. 9 (``load_balance``) or eq. 8 (plain L1).

    ``L = 1/T sum_t sum_e f_e R_te`` with ``f_e = #{t: R_te > 0} / (T * k/E)``. ``f`` comes from
    the boolean mask and carries no gradient, so the gradient of each *active* gate is
    ``f_e / T`` (times lambda and 1/L outside).
    """
    T = gates_TN.shape[0]
    if T == 0:
        return zero(gates_TN)
    # at least fp32 (bf16 gates are summed in fp32), but never below the gates' own precision
    per_expert_N = gates_TN.to(torch.promote_types(gates_TN.dtype, torch.float32)).sum(0)
    if not load_balance:
        return per_expert_N.sum() / T
    f_N = mask_TN.to(per_expert_N.dtype).sum(0) / (T * target_density)
    return (f_N.detach() * per_expert_N).sum() / T


class ReLURouter(Router):
    """Gates ``ReLU(x W)``: no bias, no normalisation; a token may activate 0..N experts."""

    uses_adaptive_reg = True

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 load_balance: bool = True, init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.target_density = target_density  # k/E
        self.load_balance = load_balance

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        gates_TN = torch.relu(self.logits(x_TD))
        mask_TN = gates_TN > 0
        reg = l1_regularizer(gates_TN, mask_TN, self.target_density, self.load_balance)
        return Routing(gates_TN, mask_TN, reg, zero(x_TD))
