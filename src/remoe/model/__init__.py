"""Model pieces: the LLaMA decoder, the MoE layer, routers, dispatch and experts."""

from transformers import AutoModelForCausalLM

from remoe.config import ReMoEConfig
from remoe.model.llama import MoEAux, ReMoEForCausalLM, ReMoEOutput
from remoe.model.moe import DenseFFN, LayerAux, MoEConfig, MoELayer, build_ffn
from remoe.model.routers import Router, RouterContext, Routing

# model_type "remoe" for transformers' AutoModelForCausalLM (AutoConfig: remoe.config)
AutoModelForCausalLM.register(ReMoEConfig, ReMoEForCausalLM, exist_ok=True)

__all__ = ["MoEAux", "ReMoEForCausalLM", "ReMoEOutput", "DenseFFN", "LayerAux", "MoEConfig",
           "MoELayer", "build_ffn", "Router", "RouterContext", "Routing"]
