"""remoe: ReLU-routed Mixture-of-Experts language models (ReMoE, ICLR 2025)."""

from transformers import AutoConfig, AutoModelForCausalLM

from remoe.config import PRESETS, ROUTERS, ReMoEConfig
from remoe.errors import ConfigError
from remoe.model import (LayerAux, MoEAux, MoEConfig, MoELayer, ReMoEForCausalLM, ReMoEOutput,
                         RouterContext, Routing)
from remoe.model.routers import Router
from remoe.registry import register_router
from remoe.sparsity import LambdaController

__version__ = "0.1.0"

AutoConfig.register("remoe", ReMoEConfig, exist_ok=True)
AutoModelForCausalLM.register(ReMoEConfig, ReMoEForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "ROUTERS", "ReMoEConfig", "ConfigError", "LayerAux", "MoEAux", "MoEConfig",
           "MoELayer", "ReMoEForCausalLM", "ReMoEOutput", "Router", "RouterContext", "Routing",
           "LambdaController", "register_router", "__version__"]
