"""Everything a saved model needs: its config (``config``: the transformers config, ``spec``:
the three sections each field is declared in once, ``registry``: router names), the LLaMA
decoder (``llama``), the MoE layer (``moe``), routers, dispatch, experts and the CPU kernel.

Light to import (PEP 562, as :mod:`remoe`): the torch-free config modules are used by
``remoe train --print-config`` and config errors without torch. The names below load on first
use; importing :mod:`remoe.model.llama` (``from remoe.model import ReMoEForCausalLM``)
registers the model with transformers' ``AutoModelForCausalLM``.
"""

from __future__ import annotations

from remoe.lazy import lazy_names

_LAZY = {
    "ReMoEConfig": "remoe.model.config",
    "MoEAux": "remoe.model.llama", "ReMoEForCausalLM": "remoe.model.llama",
    "ReMoEOutput": "remoe.model.llama",
    "DenseFFN": "remoe.model.moe", "LayerAux": "remoe.model.moe", "MoEConfig": "remoe.model.moe",
    "MoELayer": "remoe.model.moe", "build_ffn": "remoe.model.moe",
    "Router": "remoe.model.routers", "RouterContext": "remoe.model.routers",
    "Routing": "remoe.model.routers",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = list(_LAZY)
