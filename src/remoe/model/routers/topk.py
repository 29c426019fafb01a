"""The TopK baseline (dMoE): ``TopK(Softmax(x W), k*G)``, dropless, Switch load-balancing loss.

Legend: T tokens, D model width, N experts (E*G), K active experts per token.
Includes the near-dense warm-up variant of the paper's Appendix F (``warmup_k`` active experts
for the first ``warmup_steps`` optimizer steps, then ``k``).

Gates: by default the kept softmax probabilities themselves (paper eq. 2: they sum to less than
1 per token, ~K/N at initialisation). ``normalize=True`` (``model.topk_normalize``) divides them
by their sum over the kept experts, so every token's gates sum to 1 -- the renormalised TopK
of Mixtral and of Megatron-Core's default router. The mask, the load-balancing loss (computed
on the full softmax) and the experts are the same either way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.options import TopKOptions, TopKWarmupOptions


def switch_load_balancing_loss(probs_TN: Tensor, mask_TN: Tensor) -> Tensor:
    """Fedus et al. (2022): ``N * sum_e f_e P_e``, f = fraction of routed pairs, P = mean prob.

    Equals 1 under perfect balance; ``f`` carries no gradient.
    """
    T, N = probs_TN.shape
    if T == 0:
        return zero(probs_TN)
    dtype = torch.promote_types(probs_TN.dtype, torch.float32)  # at least fp32
    f_N = mask_TN.to(dtype).sum(0) / mask_TN.to(dtype).sum().clamp_min(1.0)
    P_N = probs_TN.to(dtype).mean(0)
    return N * (f_N.detach() * P_N).sum()


def topk_mask(scores_TN: Tensor, k: int) -> Tensor:
    idx_TK = scores_TN.topk(k, dim=-1).indices
    return torch.zeros_like(scores_TN, dtype=torch.bool).scatter_(1, idx_TK, True)


class TopKRouter(Router):
    """Softmax over N experts, keep the K largest; gates are the kept probabilities, optionally
    renormalised to sum to 1 per token (``normalize``)."""

    def __init__(self, d_model: int, num_experts: int, k: int, lb_coeff: float = 0.01,
                 warmup_k: int | None = None, warmup_steps: int = 0, init_std: float = 0.02,
                 normalize: bool = False) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.k = k
        self.lb_coeff = lb_coeff
        self.warmup_k = warmup_k
        self.warmup_steps = warmup_steps
        self.normalize = normalize

    options = TopKOptions

    @classmethod
    def from_config(cls, cfg) -> "TopKRouter":
        r, o = cfg.routing, cfg.options
        return cls(cfg.d_model, cfg.num_routed, r.num_active, o.lb_coeff,
                   init_std=cfg.init_std, normalize=o.topk_normalize)

    def active_k(self, step: int | None) -> int:
        """k in force at an optimizer step (``None`` = inference = after warm-up)."""
        if self.warmup_k is not None and step is not None and step < self.warmup_steps:
            return self.warmup_k
        return self.k

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        probs_TN = torch.softmax(self.logits(x_TD), dim=-1)
        k = self.active_k(ctx.step)
        mask_TN = topk_mask(probs_TN, k)
        gates_TN = probs_TN * mask_TN
        if self.normalize:  # every token's kept probabilities sum to 1 (Mixtral / Megatron)
            gates_TN = gates_TN / gates_TN.sum(dim=-1, keepdim=True)
        aux = self.lb_coeff * switch_load_balancing_loss(probs_TN, mask_TN) if self.lb_coeff else zero(x_TD)
        return Routing(gates_TN, mask_TN, zero(x_TD), aux, num_pairs=x_TD.shape[0] * k)


class TopKWarmupRouter(TopKRouter):
    """TopK with the near-dense warm-up of the paper's Appendix F (``warmup_k`` x G experts for
    the first ``warmup_steps`` optimizer steps, then k x G)."""

    options = TopKWarmupOptions

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        if step is not None and step < cfg.options.warmup_steps:
            return float(cfg.options.warmup_k * cfg.granularity)
        return super().expected_pairs(cfg, step, dense_steps)

    @classmethod
    def from_config(cls, cfg) -> "TopKWarmupRouter":
        r, o = cfg.routing, cfg.options
        G = r.granularity
        return cls(cfg.d_model, cfg.num_routed, r.top_k * G, o.lb_coeff,
                   warmup_k=o.warmup_k * G, warmup_steps=o.warmup_steps,
                   init_std=cfg.init_std, normalize=o.topk_normalize)

    @classmethod
    def validate_config(cls, cfg, prefix: str = "model.") -> None:
        from remoe.errors import ConfigError

        k, E = cfg.routing.options.warmup_k, cfg.routing.num_experts
        if k > E:
            raise ConfigError(f"{prefix}warmup_k={k} must be <= {prefix}num_experts={E}")
