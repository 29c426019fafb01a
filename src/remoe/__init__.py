"""remoe: ReLU-routed Mixture-of-Experts language models (ReMoE, ICLR 2025).

``import remoe`` is light (no torch, no transformers): the public names below are imported on
first use (PEP 562), so ``remoe --help``, ``remoe train --print-config`` and config errors stay
fast. Using the config or the model (``from remoe import ReMoEConfig``, ``ReMoEForCausalLM``,
or an import of ``remoe.model.config`` / ``remoe.model.llama``) registers model_type ``remoe`` with
transformers' ``AutoConfig`` / ``AutoModelForCausalLM``.
"""

from __future__ import annotations

from remoe.errors import ConfigError
from remoe.lazy import lazy_names
from remoe.model.registry import register_router

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "PRESETS": "remoe.model.spec", "ROUTERS": "remoe.model.spec", "ModelSpec": "remoe.model.spec",
    "BackboneConfig": "remoe.model.spec", "RoutingConfig": "remoe.model.spec",
    "SparsityControlConfig": "remoe.model.spec",
    "ReMoEConfig": "remoe.model.config",
    "LayerAux": "remoe.model.moe", "MoEAux": "remoe.model.llama", "MoEConfig": "remoe.model.moe",
    "MoELayer": "remoe.model.moe", "ReMoEForCausalLM": "remoe.model.llama",
    "ReMoEOutput": "remoe.model.llama", "RouterContext": "remoe.model.routers",
    "Routing": "remoe.model.routers", "Router": "remoe.model.routers",
    "LambdaController": "remoe.method.sparsity",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = ["ConfigError", "register_router", "__version__", *_LAZY]
