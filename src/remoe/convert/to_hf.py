"""Our model as a plain transformers Mixtral or Llama (``remoe convert to-hf``), where that is
lossless.

A dense model (``router: dense``, or ``dense_wide``: a dense SwiGLU E times as wide) is a
``LlamaForCausalLM`` with ``intermediate_size`` its FFN width: ``ffn.ffn.{w_gate,w_up,w_down}``
-> ``mlp.{gate,up,down}_proj``. q/k/v biases (``attention_bias``) become Llama's
``attention_bias``, whose output-projection bias is written as zeros (the same function);
``qk_norm`` has no Llama counterpart and is refused.

Mixtral's router is: softmax over the E experts, keep the k largest, renormalise the kept
probabilities to sum to 1. remoe's ``topk`` router with ``topk_normalize=true`` is exactly
that (``topk_warmup`` too: its warm-up only acts during training). Granularity G maps onto
Mixtral's expert count and width: E*G experts of width d_ffn/G, k*G per token.

Refused, with the reason: ``topk_normalize=false`` (our gates are the kept probabilities, which
sum to less than 1; Mixtral always renormalises, so every token's FFN output would be scaled
differently), ``relu`` (a variable number of experts per token with unnormalised gates) and
every other router (its selection or gates are not Mixtral's); and the parts Mixtral lacks
(``attention_bias``, ``qk_norm``, a shared expert).
"""

from __future__ import annotations

from typing import Any

import torch

from remoe.convert import backbone
from remoe.errors import ConfigError

LOSSLESS = ("topk", "topk_warmup")
WHY_NOT = {
    "relu": "ReLU routing activates a variable number of experts per token with unnormalised "
            "gates; Mixtral activates exactly k with softmax gates summing to 1",
}
#: our options that Mixtral's layers do not have -> why
MIXTRAL_LACKS = {"attention_bias": "Mixtral's attention has no q/k/v biases",
                 "qk_norm": "Mixtral does not normalise queries and keys",
                 "shared_expert_size": "Mixtral has no shared expert"}


def dense_kind(cfg: Any):
    """The dense FFN class of ``cfg.router`` (dense, dense_wide), or None for any other."""
    from remoe import registry
    from remoe.model.moe import DenseFFN

    kind = registry.resolve(cfg.router)
    return kind if isinstance(kind, type) and issubclass(kind, DenseFFN) else None


def check_lossless(cfg: Any) -> None:
    """Raise a one-line :class:`ConfigError` saying why ``cfg`` is not a Mixtral (a Llama for
    a dense model)."""
    if dense_kind(cfg) is not None:
        if getattr(cfg, "qk_norm", False):
            raise ConfigError("qk_norm=true cannot be written as Llama without changing the "
                              "model: Llama does not normalise queries and keys")
        return
    if cfg.router not in LOSSLESS:
        why = WHY_NOT.get(cfg.router, "its expert selection or gates differ from Mixtral's "
                                      "softmax top-k with renormalised gates")
        raise ConfigError(f"router={cfg.router!r} cannot be written as Mixtral without changing "
                          f"the model: {why}")
    if not cfg.topk_normalize:
        raise ConfigError("topk_normalize=false cannot be written as Mixtral without changing "
                          "the model: its gates are the kept softmax probabilities (summing to "
                          "less than 1), while Mixtral renormalises them to sum to 1")
    for name, why in MIXTRAL_LACKS.items():
        if getattr(cfg, name, 0):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} cannot be written as Mixtral "
                              f"without changing the model: {why}")


def to_llama(model: Any):
    """A ``LlamaForCausalLM`` computing the same logits as the dense ``model`` (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    bias = bool(getattr(cfg, "attention_bias", False))
    hf_cfg = LlamaConfig(**backbone.hf_backbone_kwargs(cfg), intermediate_size=dense_kind(
        cfg).width(cfg), attention_bias=bias, mlp_bias=False)
    sd = model.state_dict()
    out = backbone.to_hf_backbone_state(sd, cfg.num_layers, backbone.layer_map(bias))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for hf, ours in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            out[f"{p}mlp.{hf}_proj.weight"] = sd[f"layers.{i}.ffn.ffn.{ours}.weight"]
        if bias:  # Llama's attention_bias includes o_proj's: zeros, the same function
            out[f"{p}self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    with torch.device("cpu"):
        hf = LlamaForCausalLM(hf_cfg).eval()
    backbone.load_exact(hf, {k: v.contiguous() for k, v in out.items()})
    return hf


def to_hf(model: Any):
    """A ``MixtralForCausalLM`` (a ``LlamaForCausalLM`` for a dense model) computing the same
    logits as ``model`` (fp32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = model.config
    check_lossless(cfg)
    if dense_kind(cfg) is not None:
        return to_llama(model)
    N, H = cfg.num_experts * cfg.granularity, cfg.ffn_hidden_size // cfg.granularity
    hf_cfg = MixtralConfig(**backbone.hf_backbone_kwargs(cfg), intermediate_size=H,
                           num_local_experts=N, num_experts_per_tok=cfg.moe_top_k * cfg.granularity,
                           router_jitter_noise=0.0)
    sd = model.state_dict()
    out = backbone.to_hf_backbone_state(sd, cfg.num_layers)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        out[p + "gate.weight"] = sd[f"layers.{i}.ffn.router.weight"]
        out[p + "experts.gate_up_proj"] = sd[f"layers.{i}.ffn.experts.w_in_ND2H"].transpose(1, 2)
        out[p + "experts.down_proj"] = sd[f"layers.{i}.ffn.experts.w_out_NHD"].transpose(1, 2)
    with torch.device("cpu"):
        hf = MixtralForCausalLM(hf_cfg).eval()
    backbone.load_exact(hf, {k: v.contiguous() for k, v in out.items()})
    return hf
