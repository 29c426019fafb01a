"""Routers: one interface (:class:`Router` -> :class:`Routing`), one registry.

``build_router(cfg)`` maps ``MoEConfig.router`` to a router; each module holds one method.
"""

from __future__ import annotations

from remoe.model.routers.base import Router, RouterContext, Routing
from remoe.model.routers.relu import ReLURouter, l1_regularizer
from remoe.model.routers.topk import TopKRouter, switch_load_balancing_loss


def build_router(cfg) -> Router:
    """Build the router named by ``cfg.router`` (a :class:`remoe.model.moe.MoEConfig`)."""
    N, D, G = cfg.num_experts * cfg.granularity, cfg.d_model, cfg.granularity
    density = cfg.top_k / cfg.num_experts
    std = cfg.init_std
    if cfg.router == "relu":
        return ReLURouter(D, N, density, load_balance=cfg.reg_type == "lb", init_std=std,
                          max_active=getattr(cfg, "max_active", 0),
                          gate_threshold=getattr(cfg, "gate_threshold", 0.0),
                          revive_coeff=getattr(cfg, "revive_coeff", 1e-2))
    if cfg.router == "topk":
        return TopKRouter(D, N, cfg.top_k * G, cfg.lb_coeff, init_std=std,
                          normalize=cfg.topk_normalize)
    if cfg.router == "topk_warmup":
        return TopKRouter(D, N, cfg.top_k * G, cfg.lb_coeff, warmup_k=cfg.warmup_k * G,
                          warmup_steps=cfg.warmup_steps, init_std=std,
                          normalize=cfg.topk_normalize)
    if cfg.router == "hash":
        from remoe.model.routers.hash import HashRouter

        return HashRouter(D, N, cfg.top_k * G, init_std=std)
    if cfg.router == "expert_choice":
        from remoe.model.routers.expert_choice import ExpertChoiceRouter

        return ExpertChoiceRouter(D, N, cfg.top_k * G, cfg.capacity_factor, init_std=std)
    if cfg.router == "sparsemixer":
        from remoe.model.routers.sparsemixer import SparseMixerRouter

        return SparseMixerRouter(D, N, cfg.top_k * G, cfg.lb_coeff, cfg.sparsemixer_jitter,
                                 init_std=std)
    raise ValueError(f"model.router={cfg.router!r} has no token router (dense/lory are FFNs)")


__all__ = ["Router", "RouterContext", "Routing", "ReLURouter", "TopKRouter", "build_router",
           "l1_regularizer", "switch_load_balancing_loss"]
