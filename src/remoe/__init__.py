"""remoe: ReLU-routed Mixture-of-Experts language models (ReMoE, ICLR 2025).

``import remoe`` is light (no torch, no transformers): the public names below are imported on
first use (PEP 562), so ``remoe --help``, ``remoe train --print-config`` and config errors stay
fast. Using the config or the model (``from remoe import ReMoEConfig``, ``ReMoEForCausalLM``,
or any ``remoe.config`` / ``remoe.model`` import) registers model_type ``remoe`` with
transformers' ``AutoConfig`` / ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import importlib
from typing import Any

from remoe.errors import ConfigError
from remoe.registry import register_router

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "PRESETS": "remoe.model_spec", "ROUTERS": "remoe.model_spec", "ModelSpec": "remoe.model_spec",
    "BackboneConfig": "remoe.model_spec", "RoutingConfig": "remoe.model_spec",
    "SparsityControlConfig": "remoe.model_spec",
    "ReMoEConfig": "remoe.config",
    "LayerAux": "remoe.model", "MoEAux": "remoe.model", "MoEConfig": "remoe.model",
    "MoELayer": "remoe.model", "ReMoEForCausalLM": "remoe.model", "ReMoEOutput": "remoe.model",
    "RouterContext": "remoe.model", "Routing": "remoe.model", "Router": "remoe.model",
    "LambdaController": "remoe.sparsity",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'remoe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["ConfigError", "register_router", "__version__", *_LAZY]
