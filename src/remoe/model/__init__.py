"""Model pieces: the LLaMA decoder, the MoE layer, routers, dispatch and experts."""

from remoe.model.llama import MoEAux, ReMoEForCausalLM, ReMoEOutput
from remoe.model.moe import DenseFFN, LayerAux, MoEConfig, MoELayer, build_ffn
from remoe.model.routers import Router, RouterContext, Routing

__all__ = ["MoEAux", "ReMoEForCausalLM", "ReMoEOutput", "DenseFFN", "LayerAux", "MoEConfig",
           "MoELayer", "build_ffn", "Router", "RouterContext", "Routing"]
