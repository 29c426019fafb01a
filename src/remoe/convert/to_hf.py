"""Our model as a plain transformers Mixtral (``remoe convert to-hf``), where that is lossless.

Mixtral's router is: softmax over the E experts, keep the k largest, renormalise the kept
probabilities to sum to 1. remoe's ``topk`` router with ``topk_normalize=true`` is exactly
that (``topk_warmup`` too: its warm-up only acts during training). Granularity G maps onto
Mixtral's expert count and width: E*G experts of width d_ffn/G, k*G per token.

Refused, with the reason: ``topk_normalize=false`` (our gates are the kept probabilities, which
sum to less than 1; Mixtral always renormalises, so every token's FFN output would be scaled
differently), ``relu`` (a variable number of experts per token with unnormalised gates) and
every other router (its selection or gates are not Mixtral's).
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
    "dense": "a dense model has no experts (it is a Llama, not a Mixtral)",
}


def check_lossless(cfg: Any) -> None:
    """Raise a one-line :class:`ConfigError` saying why ``cfg`` is not a Mixtral."""
    if cfg.router not in LOSSLESS:
        why = WHY_NOT.get(cfg.router, "its expert selection or gates differ from Mixtral's "
                                      "softmax top-k with renormalised gates")
        raise ConfigError(f"router={cfg.router!r} cannot be written as Mixtral without changing "
                          f"the model: {why}")
    if not cfg.topk_normalize:
        raise ConfigError("topk_normalize=false cannot be written as Mixtral without changing "
                          "the model: its gates are the kept softmax probabilities (summing to "
                          "less than 1), while Mixtral renormalises them to sum to 1")


def to_hf(model: Any):
    """A ``MixtralForCausalLM`` computing the same logits as ``model`` (fp32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = model.config
    check_lossless(cfg)
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
