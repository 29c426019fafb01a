"""ReMoE's ReLU router: ``R = ReLU(x W)`` with the (load-balanced) L1 regulariser.

Legend: T tokens, D model width, N experts (E*G).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, bias_update, zero
from remoe.model.routers.options import ReLUOptions


def relu_options(options) -> ReLUOptions:
    """The ReLU options in ``options``: the router's own (a user router deriving from
    :class:`ReLURouter` gets them by deriving its options from :class:`ReLUOptions`), else the
    defaults (the paper's router). By field names, not isinstance: transformers may load a
    saved model's bundled code twice (config and model), each copy with its own classes."""
    have = {f.name for f in dataclasses.fields(options)} if options is not None else set()
    return options if _RELU_FIELDS <= have else ReLUOptions()


_RELU_FIELDS = {f.name for f in dataclasses.fields(ReLUOptions)}


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


def revival_hinge(logits_TN: Tensor, dead_N: Tensor, target_density: float) -> Tensor:
    """Pull each dead expert's nearest tokens back across zero: ``mean relu(-z)`` over the
    ``ceil(T * k/E)`` tokens with the largest pre-activation logit ``z`` of that expert, summed
    over dead experts.

    A ReLU gate at zero gets no gradient, so an expert whose logits went negative for every
    token never comes back by itself; this term gives its router row a gradient towards the
    tokens it is closest to serving, and vanishes as soon as they are active again.
    """
    T = logits_TN.shape[0]
    if T == 0:
        return zero(logits_TN)
    m = max(1, min(T, math.ceil(T * target_density)))
    z_TM = logits_TN[:, dead_N]  # [T, dead]
    top_mM = z_TM.topk(m, dim=0).values
    return torch.relu(-top_mM).mean(0).sum()


class ReLURouter(Router):
    """Gates ``ReLU(x W)``: no bias, no normalisation; a token may activate 0..N experts.

    Options (all off by default, which is the paper's router): ``max_active`` caps the experts
    a token may use (the largest gates are kept); ``gate_threshold`` tau, at inference only,
    counts gates <= tau as inactive (a compute dial; tau = 0 is the plain ReLU router);
    ``ctx.revive_N`` (in training) switches on the revival hinge for the given experts;
    ``balance_bias_rate`` r > 0 makes the gates ``ReLU(x W + b)`` with a per-expert offset ``b``
    (a buffer, no gradient) that :meth:`after_step` moves by the centred sign step of the
    auxiliary-loss-free balancer (:func:`bias_update`): ``+r`` for an expert under its layer's
    mean load, ``-r`` over it. A starving expert's offset rises until tokens cross zero again,
    so it gets gradients back; the sum of the offsets stays 0, so the layer's density is left
    to lambda.
    """

    uses_adaptive_reg = True

    def __init__(self, d_model: int, num_experts: int, target_density: float,
                 load_balance: bool = True, init_std: float = 0.02, max_active: int = 0,
                 gate_threshold: float = 0.0, revive_coeff: float = 1e-2,
                 balance_bias_rate: float = 0.0) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.target_density = target_density  # k/E
        self.load_balance = load_balance
        self.max_active = max_active if 0 < max_active < num_experts else 0
        self.gate_threshold = float(gate_threshold)
        self.revive_coeff = float(revive_coeff)
        self.balance_bias_rate = float(balance_bias_rate)
        if self.balance_bias_rate > 0:  # off: no buffer, the paper's state dict
            self.register_buffer("expert_bias_N", torch.zeros(num_experts, dtype=torch.float32),
                                 persistent=True)

    options = ReLUOptions

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        if step is not None and step < dense_steps:
            # stage I: a ReLU gate of a zero-mean logit is open half of the time (N/2 experts
            # per token), bounded by the cap on experts per token when there is one
            n = cfg.num_routed / 2.0
            cap = relu_options(cfg.options).max_active
            return float(min(n, cap)) if cap else n
        return super().expected_pairs(cfg, step, dense_steps)

    @classmethod
    def from_config(cls, cfg) -> "ReLURouter":
        o = relu_options(cfg.options)
        return cls(cfg.d_model, cfg.num_routed, cfg.target_density,
                   load_balance=o.reg_type == "lb", init_std=cfg.init_std,
                   max_active=o.max_active, gate_threshold=o.gate_threshold,
                   revive_coeff=o.revive_coeff, balance_bias_rate=o.balance_bias_rate)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        logits_TN = self.logits(x_TD)
        if self.balance_bias_rate > 0:
            logits_TN = logits_TN + self.expert_bias_N.to(logits_TN.dtype)
        gates_TN = torch.relu(logits_TN)
        if self.max_active:
            keep_TN = topk_keep(gates_TN, self.max_active)
            gates_TN = gates_TN * keep_TN
        if self.gate_threshold > 0 and not self.training:
            gates_TN = gates_TN * (gates_TN > self.gate_threshold)
        mask_TN = gates_TN > 0
        reg = l1_regularizer(gates_TN, mask_TN, self.target_density, self.load_balance)
        aux = zero(x_TD)
        if ctx.revive_N is not None and self.training:
            dead_N = ctx.revive_N.to(logits_TN.device)
            with torch.autocast(device_type=x_TD.device.type, enabled=False):
                z_TN = x_TD.detach().to(logits_TN.dtype) @ self.weight.to(logits_TN.dtype).t()
            aux = self.revive_coeff * revival_hinge(z_TN, dead_N, self.target_density)
        cap = x_TD.shape[0] * self.max_active if self.max_active else None
        return Routing(gates_TN, mask_TN, reg, aux, max_pairs=cap)

    @torch.no_grad()
    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """``balance_bias_rate``: move each expert's offset against the step's load error
        (``counts_N``: tokens per expert over micro-batches and ranks, the same on every rank)."""
        if self.balance_bias_rate > 0:
            delta_N = bias_update(counts_N.detach().cpu(), self.balance_bias_rate)
            self.expert_bias_N.add_(delta_N.to(self.expert_bias_N))


def topk_keep(gates_TN: Tensor, c: int) -> Tensor:
    """float {0,1} [T, N]: the ``c`` largest gates of each token (no gradient through the choice)."""
    idx_TC = gates_TN.detach().topk(c, dim=-1).indices
    return torch.zeros_like(gates_TN).scatter_(1, idx_TC, 1.0)
