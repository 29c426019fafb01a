"""PEFT LoRA for remoe models: which modules and parameters to adapt (docs/FINETUNE.md).

PEFT's ``"all-linear"`` finds only remoe's ``nn.Linear`` layers (attention, a dense FFN, a
shared expert): the routed experts are two stacked 3-D parameters per layer, ``w_in_ND2H``
``[N, D, 2H]`` and ``w_out_NHD`` ``[N, H, D]``, and the router is a plain ``[N, D]``
parameter. :func:`lora_config` names them: the experts through PEFT's ``target_parameters``
(one rank-``r`` update per expert; the layout is PEFT's ``[experts, in, out]``, and the MoE
layer calls the wrapped experts through PEFT so the update applies), the router frozen (the
default: the learned routing and its sparsity are kept) or trained in full
(``modules_to_save``; merged back by ``merge_and_unload``).
"""

from __future__ import annotations

from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_FFN = ("w_gate", "w_up", "w_down")  # a dense FFN's and a shared expert's linears
EXPERT_PARAMS = ("experts.w_in_ND2H", "experts.w_out_NHD")
ROUTER_CHOICES = ("frozen", "trained")


def lora_config(model, r: int = 8, alpha: float | None = None, attention: bool = True,
                experts: bool = True, router: str = "frozen", **kwargs: Any):
    """A ``peft.LoraConfig`` for ``model`` (a ReMoEForCausalLM): LoRA of rank ``r`` (scale
    ``alpha / r``, default ``alpha = 2r``) on the attention projections and on every expert
    (the routed experts' stacked weights, a dense FFN or shared expert's linears); the router
    ``"frozen"`` or ``"trained"`` (a full trainable copy). Extra ``kwargs`` go to LoraConfig
    (``lora_dropout`` must stay 0: PEFT cannot apply dropout to a parameter update)."""
    from peft import LoraConfig

    from remoe.errors import ConfigError
    from remoe.model.experts import SwiGLU
    from remoe.model.moe import MoELayer

    if router not in ROUTER_CHOICES:
        raise ConfigError(f"router={router!r} must be one of {', '.join(ROUTER_CHOICES)}")
    if not (attention or experts):
        raise ConfigError("lora_config: adapt the attention, the experts or both")
    modules = list(ATTENTION) if attention else []
    params: list[str] = []
    moe = any(isinstance(m, MoELayer) for m in model.modules())
    if experts:
        if any(isinstance(m, SwiGLU) for m in model.modules()):
            modules += DENSE_FFN
        if moe:
            params += EXPERT_PARAMS
    if router == "trained" and not moe:
        raise ConfigError("router='trained': the model has no router (router: dense)")
    return LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha,
                      target_modules=modules or None, target_parameters=params or None,
                      modules_to_save=["router"] if router == "trained" else None,
                      lora_dropout=kwargs.pop("lora_dropout", 0.0), task_type="CAUSAL_LM",
                      **kwargs)
