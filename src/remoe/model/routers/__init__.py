"""Routers: one interface (:class:`Router` -> :class:`Routing`), one registry.

``build_router(cfg)`` maps ``MoEConfig.routing.router`` to a router through
:mod:`remoe.model.registry`; each module holds one method and declares what the rest of remoe
needs to know about it, its options dataclass included (:mod:`remoe.model.routers.options`,
torch-free). Light to import (PEP 562): reading a config imports the options module only.
"""

from __future__ import annotations

from remoe.lazy import lazy_names

_LAZY = {
    "Router": "remoe.model.routers.base", "RouterContext": "remoe.model.routers.base",
    "Routing": "remoe.model.routers.base", "build_router": "remoe.model.moe",
    "ReLURouter": "remoe.model.routers.relu", "l1_regularizer": "remoe.model.routers.relu",
    "TopKRouter": "remoe.model.routers.topk", "TopKWarmupRouter": "remoe.model.routers.topk",
    "switch_load_balancing_loss": "remoe.model.routers.topk",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = list(_LAZY)
