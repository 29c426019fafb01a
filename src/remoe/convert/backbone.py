"""The LLaMA backbone shared by remoe and transformers' Llama/Mixtral: config fields and the
non-FFN weights (embeddings, attention, RMSNorms, final norm, LM head), in both directions.

Both sides compute the same backbone: pre-norm RMSNorm blocks (fp32 normalisation), RoPE with
``rotate_half`` on the two halves of each head, grouped-query attention, SwiGLU, no biases;
optionally q/k/v biases (Qwen2's ``qkv_bias``: our ``attention_bias``) and an RMSNorm over the
whole q and k projections (OLMoE's ``q_norm``/``k_norm``: our ``qk_norm``), mapped by
:func:`layer_map`. What transformers can express and remoe cannot (an output-projection or MLP
bias, a head width other than ``hidden_size / num_heads``, scaled RoPE, sliding-window
attention shorter than the context, another activation) is refused with a one-line
:class:`ConfigError`.
"""

from __future__ import annotations

from typing import Any

import torch

from remoe.errors import ConfigError

#: our per-layer backbone parameter -> transformers' (under ``model.layers.{i}.``)
LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def layer_map(attention_bias: bool = False, qk_norm: bool = False) -> dict[str, str]:
    """:data:`LAYER_MAP` plus the q/k/v biases and the q/k norms when the model has them."""
    out = dict(LAYER_MAP)
    if attention_bias:
        out.update({f"attn.{n}_proj.bias": f"self_attn.{n}_proj.bias" for n in "qkv"})
    if qk_norm:
        out.update({f"attn.{n}_norm.weight": f"self_attn.{n}_norm.weight" for n in "qk"})
    return out


#: our top-level parameter -> transformers'
TOP_MAP = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}


def rope_theta(hf_cfg: Any) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in v5, ``rope_theta`` before);
    refuses scaled RoPE (linear, dynamic, YaRN, llama3), which remoe does not implement."""
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = getattr(hf_cfg, "rope_scaling", None)
    scaled = isinstance(scaling, dict) and \
        scaling.get("rope_type", scaling.get("type")) not in (None, "default")
    if kind != "default" or scaled:
        raise ConfigError(f"rope_type={kind!r} must be 'default': remoe has no scaled RoPE")
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    if theta is None:
        raise ConfigError("rope_theta is missing from the source config")
    return float(theta)


def backbone_kwargs(hf_cfg: Any, qkv_bias: bool = False, qk_norm: bool = False
                    ) -> dict[str, Any]:
    """ReMoEConfig fields of the backbone of a transformers Llama/Mixtral/Qwen2-MoE/OLMoE
    config (checked); ``qkv_bias`` / ``qk_norm``: the source has them (the caller knows its
    family)."""
    D, Hq = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    Hkv = getattr(hf_cfg, "num_key_value_heads", None) or Hq
    head_dim = getattr(hf_cfg, "head_dim", None) or D // Hq
    if head_dim * Hq != D:
        raise ConfigError(f"head_dim={head_dim} must equal hidden_size/num_attention_heads="
                          f"{D // Hq}: remoe derives the head width from the model width")
    for name in ("attention_bias", "mlp_bias"):  # Llama/OLMoE: o_proj (or MLP) biases too
        if getattr(hf_cfg, name, False):
            raise ConfigError(f"{name}=true must be false: remoe has q/k/v biases only "
                              "(model.attention_bias), no output-projection or MLP bias")
    act = getattr(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} must be 'silu' (SwiGLU)")
    window = getattr(hf_cfg, "sliding_window", None)
    if getattr(hf_cfg, "use_sliding_window", True) is False:  # Qwen2: the window is switched off
        window = None
    ctx = hf_cfg.max_position_embeddings
    if "sliding_attention" in (getattr(hf_cfg, "layer_types", None) or ()) or \
            (window is not None and window < ctx):
        raise ConfigError(f"sliding_window={window} must be null or >= max_position_embeddings="
                          f"{ctx}: remoe attends to the whole context")
    eos = hf_cfg.eos_token_id[0] if isinstance(hf_cfg.eos_token_id, list) else hf_cfg.eos_token_id
    return dict(vocab_size=hf_cfg.vocab_size, hidden_size=D, num_layers=hf_cfg.num_hidden_layers,
                num_heads=Hq, num_kv_heads=Hkv, max_position_embeddings=ctx,
                rope_theta=rope_theta(hf_cfg), rms_norm_eps=float(hf_cfg.rms_norm_eps),
                init_std=float(getattr(hf_cfg, "initializer_range", 0.02)),
                eos_token_id=eos, bos_token_id=hf_cfg.bos_token_id,
                pad_token_id=hf_cfg.pad_token_id if hf_cfg.pad_token_id is not None else eos,
                attention_bias=bool(qkv_bias), qk_norm=bool(qk_norm))


def hf_backbone_kwargs(cfg: Any) -> dict[str, Any]:
    """transformers Llama/Mixtral config fields of our backbone (the inverse of the above;
    ``cfg``: a ReMoEConfig)."""
    b = cfg.backbone
    return dict(vocab_size=b.vocab_size, hidden_size=b.hidden_size,
                num_hidden_layers=b.num_layers, num_attention_heads=b.num_heads,
                num_key_value_heads=b.num_kv_heads, head_dim=b.head_dim,
                max_position_embeddings=b.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": float(b.rope_theta)},
                rms_norm_eps=b.rms_norm_eps, initializer_range=b.init_std,
                hidden_act="silu", tie_word_embeddings=False, sliding_window=None,
                attention_dropout=0.0, bos_token_id=cfg.bos_token_id,
                eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)


def hf_backbone_state(hf_sd: dict[str, torch.Tensor], num_layers: int, tied: bool = False,
                      lmap: dict[str, str] = LAYER_MAP) -> dict[str, torch.Tensor]:
    """Our backbone parameters from a transformers state dict (tied embeddings: the LM head
    is a copy of the embedding, untied from then on); ``lmap``: see :func:`layer_map`."""
    out = {ours: hf_sd["model.embed_tokens.weight" if (ours == "lm_head.weight" and tied) else hf]
           for ours, hf in TOP_MAP.items()}
    for i in range(num_layers):
        for ours, hf in lmap.items():
            out[f"layers.{i}.{ours}"] = hf_sd[f"model.layers.{i}.{hf}"]
    return out


def to_hf_backbone_state(sd: dict[str, torch.Tensor], num_layers: int,
                         lmap: dict[str, str] = LAYER_MAP) -> dict[str, torch.Tensor]:
    """transformers' backbone parameters from our state dict."""
    out = {hf: sd[ours] for ours, hf in TOP_MAP.items()}
    for i in range(num_layers):
        for ours, hf in lmap.items():
            out[f"model.layers.{i}.{hf}"] = sd[f"layers.{i}.{ours}"]
    return out


def load_exact(module: torch.nn.Module, state: dict[str, torch.Tensor], ignore=()) -> None:
    """Copy ``state`` into ``module``; every parameter not under an ``ignore`` prefix must be
    given, with its exact shape (a silent partial copy would be a wrong model)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(tuple(ignore))]
    extra = [k for k in state if k not in own]
    if missing or extra:
        raise ConfigError(f"weights do not map: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ConfigError(f"{k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
