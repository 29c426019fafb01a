"""Our model as a plain transformers Mixtral, Qwen2-MoE, OLMoE or Llama (``remoe convert
to-hf``), where that is lossless.

The family is chosen by what the model has (:func:`family`): a dense model (``router: dense``,
or ``dense_wide``: a dense SwiGLU E times as wide) is a ``LlamaForCausalLM`` with
``intermediate_size`` its FFN width (``ffn.ffn.{w_gate,w_up,w_down}`` ->
``mlp.{gate,up,down}_proj``); q/k/v biases (``attention_bias``) become Llama's
``attention_bias``, whose output-projection bias is written as zeros (the same function);
``qk_norm`` has no Llama counterpart and is refused. A TopK model with ``qk_norm`` is an OLMoE,
one with a shared expert (and optionally q/k/v biases) a Qwen2-MoE, any other a Mixtral.

The three routers are softmax over the experts and top-k; remoe's ``topk`` router (and
``topk_warmup``: its warm-up only acts during training) is the same, with ``topk_normalize`` as
Mixtral's renormalisation (always on) or Qwen2-MoE's / OLMoE's ``norm_topk_prob``. Granularity
G maps onto the expert count and width: E*G experts of width d_ffn/G, k*G per token.

Refused, with the reason: ``topk_normalize=false`` as Mixtral (our gates are the kept
probabilities, which sum to less than 1; Mixtral always renormalises), ``relu`` (a variable
number of experts per token with unnormalised gates) and every other router (its selection or
gates are not softmax top-k); q/k/v biases without a shared expert (Qwen2-MoE always has one,
Mixtral has no biases), an ungated shared expert, a shared expert with ``qk_norm``.
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
NAMES = {"llama": "Llama", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "olmoe": "OLMoE"}


def dense_kind(cfg: Any):
    """The dense FFN class of ``cfg``'s router (dense, dense_wide), or None for any other
    (``cfg``: a ReMoEConfig, as every ``cfg`` below)."""
    from remoe.model import registry
    from remoe.model.moe import DenseFFN

    kind = registry.resolve(cfg.routing.router)
    return kind if isinstance(kind, type) and issubclass(kind, DenseFFN) else None


def family(cfg: Any) -> str:
    """The transformers family that can express ``cfg``: ``llama`` (dense), ``olmoe`` (q/k
    norm), ``qwen2_moe`` (a shared expert or q/k/v biases) or ``mixtral``."""
    if dense_kind(cfg) is not None:
        return "llama"
    if cfg.backbone.qk_norm:
        return "olmoe"
    if cfg.routing.shared_expert_size or cfg.backbone.attention_bias:
        return "qwen2_moe"
    return "mixtral"


def _refuse(name: str, value: Any, fam: str, why: str) -> None:
    value = str(value).lower() if isinstance(value, bool) else repr(value)  # as in YAML
    raise ConfigError(f"{name}={value} cannot be written as {NAMES[fam]} without changing "
                      f"the model: {why}")


def check_lossless(cfg: Any) -> None:
    """Raise a one-line :class:`ConfigError` saying why ``cfg`` is not a model of its
    :func:`family`."""
    fam, r = family(cfg), cfg.routing
    if fam == "llama":
        if cfg.backbone.qk_norm:
            _refuse("qk_norm", True, fam, "Llama does not normalise queries and keys")
        return
    if r.router not in LOSSLESS:
        _refuse("router", r.router, fam, WHY_NOT.get(
            r.router, f"its expert selection or gates differ from {NAMES[fam]}'s softmax "
            "top-k"))
    if fam == "mixtral" and not r.options.topk_normalize:
        _refuse("topk_normalize", False, fam, "its gates are the kept softmax probabilities "
                "(summing to less than 1), while Mixtral renormalises them to sum to 1")
    shared = r.shared_expert_size
    if fam == "olmoe" and shared:
        _refuse("shared_expert_size", shared, fam, "OLMoE has no shared expert")
    if fam == "qwen2_moe" and not shared:
        _refuse("attention_bias", True, fam, "Qwen2-MoE always has a shared expert, and "
                "Mixtral's attention has no q/k/v biases")
    if fam == "qwen2_moe" and not r.shared_expert_gate:
        _refuse("shared_expert_gate", False, fam, "Qwen2-MoE always gates its shared expert")


def to_llama(model: Any):
    """A ``LlamaForCausalLM`` computing the same logits as the dense ``model`` (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    b = cfg.backbone
    hf_cfg = LlamaConfig(**backbone.hf_backbone_kwargs(cfg), intermediate_size=dense_kind(
        cfg).width(cfg.spec), attention_bias=b.attention_bias, mlp_bias=False)
    sd = model.state_dict()
    out = backbone.to_hf_backbone_state(sd, b.num_layers, backbone.layer_map(b.attention_bias))
    for i in range(b.num_layers):
        p = f"model.layers.{i}."
        for hf, ours in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
            out[f"{p}mlp.{hf}_proj.weight"] = sd[f"layers.{i}.ffn.ffn.{ours}.weight"]
        if b.attention_bias:  # Llama's attention_bias includes o_proj's: zeros, the same
            out[f"{p}self_attn.o_proj.bias"] = torch.zeros(b.hidden_size)  # function
    return _build(LlamaForCausalLM, hf_cfg, out)


def _build(cls, hf_cfg, state):
    with torch.device("cpu"):
        hf = cls(hf_cfg).eval()
    backbone.load_exact(hf, {k: v.contiguous() for k, v in state.items()})
    return hf


def _moe_config(cfg: Any, fam: str):
    """The transformers config of a TopK model of family ``fam`` (E*G experts of width
    d_ffn/G, k*G per token)."""
    import transformers

    b, r = cfg.backbone, cfg.routing
    N, H = r.num_routed, b.ffn_hidden_size // r.granularity
    kw = dict(backbone.hf_backbone_kwargs(cfg), num_experts_per_tok=r.num_active)
    if fam == "mixtral":
        return transformers.MixtralConfig(**kw, intermediate_size=H, num_local_experts=N,
                                          router_jitter_noise=0.0)
    norm = r.options.topk_normalize
    if fam == "olmoe":
        return transformers.OlmoeConfig(**kw, intermediate_size=H, num_experts=N,
                                        norm_topk_prob=norm, clip_qkv=None,
                                        attention_bias=bool(b.attention_bias))
    return transformers.Qwen2MoeConfig(
        **kw, num_experts=N, moe_intermediate_size=H, norm_topk_prob=norm,
        intermediate_size=r.shared_expert_size, qkv_bias=bool(b.attention_bias),
        shared_expert_intermediate_size=r.shared_expert_size, decoder_sparse_step=1,
        mlp_only_layers=[], use_sliding_window=False)


def to_hf(model: Any):
    """The transformers model of :func:`family` (``MixtralForCausalLM``,
    ``Qwen2MoeForCausalLM``, ``OlmoeForCausalLM``; ``LlamaForCausalLM`` for a dense model)
    computing the same logits as ``model`` (fp32)."""
    import transformers

    cfg = model.config
    check_lossless(cfg)
    fam = family(cfg)
    if fam == "llama":
        return to_llama(model)
    b = cfg.backbone
    bias, qk = b.attention_bias, b.qk_norm
    sd = model.state_dict()
    out = backbone.to_hf_backbone_state(sd, b.num_layers, backbone.layer_map(bias, qk))
    for i in range(b.num_layers):
        p, q = f"model.layers.{i}.mlp.", f"layers.{i}.ffn."
        out[p + "gate.weight"] = sd[q + "router.weight"]
        out[p + "experts.gate_up_proj"] = sd[q + "experts.w_in_ND2H"].transpose(1, 2)
        out[p + "experts.down_proj"] = sd[q + "experts.w_out_NHD"].transpose(1, 2)
        if fam == "qwen2_moe":
            for hf, ours in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
                out[f"{p}shared_expert.{hf}_proj.weight"] = \
                    sd[f"{q}shared_expert.ffn.{ours}.weight"]
            out[p + "shared_expert_gate.weight"] = sd[q + "shared_expert.gate.weight"]
        if fam == "olmoe" and bias:  # OLMoE's attention_bias includes o_proj's: zeros
            out[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(b.hidden_size)
    cls = {"mixtral": transformers.MixtralForCausalLM, "olmoe": transformers.OlmoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[fam]
    return _build(cls, _moe_config(cfg, fam), out)
