"""Routers: one interface (:class:`Router` -> :class:`Routing`), one registry.

``build_router(cfg)`` maps ``MoEConfig.router`` to a router through :mod:`remoe.model.registry`;
each module holds one method and declares what the rest of remoe needs to know about it.
"""

from __future__ import annotations

from remoe.model.routers.base import Router, RouterContext, Routing
from remoe.model.routers.relu import ReLURouter, l1_regularizer
from remoe.model.routers.topk import TopKRouter, TopKWarmupRouter, switch_load_balancing_loss


def build_router(cfg) -> Router:
    """Build the token router named by ``cfg.router`` (a :class:`remoe.model.moe.MoEConfig`)
    through :mod:`remoe.model.registry`: built-ins and routers registered by user modules alike."""
    from remoe.model import registry

    cls = registry.resolve(cfg.router)
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise ValueError(f"model.router={cfg.router!r} is an FFN kind, not a token router")
    return cls.from_config(cfg)


__all__ = ["Router", "RouterContext", "Routing", "ReLURouter", "TopKRouter", "TopKWarmupRouter",
           "build_router",
           "l1_regularizer", "switch_load_balancing_loss"]
