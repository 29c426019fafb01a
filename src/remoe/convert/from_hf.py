"""Router swap: a transformers Mixtral, Qwen2-MoE or OLMoE becomes a ReMoE with its experts kept
(``remoe convert from-hf``), so an existing MoE can be trained further with ReLU routing.

Mapping (per layer; the fused expert tensors of transformers >= 5, the same in all three):
``experts.gate_up_proj[e]`` ``[2F, D]`` -> ``w_in_ND2H[e] = gate_up_proj[e]^T`` ``[D, 2F]``
(gate first on both sides); ``experts.down_proj[e]`` ``[D, F]`` -> ``w_out_NHD[e]``
``[F, D]``; ``gate.weight`` ``[E, D]`` -> ``router.weight`` ``[E, D]``; the backbone through
:mod:`remoe.convert.backbone`. What each family adds:

* Qwen2-MoE: q/k/v biases (``qkv_bias`` -> ``attention_bias``) and a shared expert
  (``shared_expert.{gate,up,down}_proj`` of width ``shared_expert_intermediate_size`` ->
  ``shared_expert.ffn.{w_gate,w_up,w_down}``, ``shared_expert_gate`` -> ``shared_expert.gate``:
  ``shared_expert_size``); its routed experts are ``moe_intermediate_size`` wide;
* OLMoE: RMSNorm over the whole q and k projections (``q_norm``/``k_norm`` -> ``qk_norm``).

Router: ``--router topk`` keeps the source's function exactly: softmax, top-k, and the kept
probabilities renormalised to sum to 1 when the source does it (Mixtral always; Qwen2-MoE and
OLMoE when ``norm_topk_prob``) -- remoe's ``topk`` with ``topk_normalize`` set the same way, the
same W and the same k. ``--router relu`` (the default) initialises ReLU(x W') from the softmax
router with ``W' = W - mean_e W_e``: the softmax is unchanged by subtracting the same vector
from every row, so W' is the same softmax router, but its logits are centred per token, so
ReLU(x W') keeps the experts whose logit is above the token's mean logit -- the experts the
softmax ranks highest -- with gates equal to that margin. What changes in the function: the
number of active experts per token is no longer fixed at k (about half of the experts pass at
first) and the gates are unnormalised logit margins instead of probabilities, so the converted
model is not the source function; ReMoE's L1 control then steers it to the target sparsity
1 - k/E while it trains. A shared expert is outside the router and stays as it is.

Refused with the reason: Qwen2-MoE with dense layers (``mlp_only_layers``,
``decoder_sparse_step`` > 1; remoe's layers are all MoE layers), OLMoE's ``clip_qkv``, and
what the backbone refuses.
"""

from __future__ import annotations

from typing import Any

import torch

from remoe.convert import backbone
from remoe.errors import ConfigError

ROUTERS = ("relu", "topk")
#: model types we read
SOURCES = ("mixtral", "qwen2_moe", "olmoe")
#: MoE model types we know and cannot convert, with the reason
UNSUPPORTED = {
    "qwen3_moe": "Qwen3-MoE normalises each query/key head on its own (RMSNorm over head_dim); "
                 "remoe's qk_norm spans the whole projection, as OLMoE's",
    "deepseek_v3": "DeepSeek-V3 routes with sigmoid scores within expert groups and uses "
                   "multi-head latent attention, which remoe does not have",
    "phimoe": "PhiMoE uses LayerNorm (with biases) and attention biases; remoe uses RMSNorm",
    "granitemoe": "Granite-MoE scales embeddings, attention, residuals and logits by "
                  "multipliers, which remoe does not have",
}
_SHARED = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def _family(cfg: Any) -> dict[str, Any]:
    """What a source config says about its MoE layer and attention (checked)."""
    kind = cfg.model_type
    if kind == "mixtral":
        return dict(experts=cfg.num_local_experts, width=cfg.intermediate_size, normalize=True,
                    qkv_bias=False, qk_norm=False, shared=0)
    if kind == "qwen2_moe":
        dense = list(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1)
        if dense or step != 1:
            raise ConfigError(f"Qwen2-MoE with dense layers (mlp_only_layers={dense}, "
                              f"decoder_sparse_step={step}) cannot be converted: every remoe "
                              "layer is an MoE layer")
        return dict(experts=cfg.num_experts, width=cfg.moe_intermediate_size,
                    normalize=bool(cfg.norm_topk_prob), qkv_bias=bool(cfg.qkv_bias),
                    qk_norm=False, shared=int(cfg.shared_expert_intermediate_size))
    if kind == "olmoe":
        if getattr(cfg, "clip_qkv", None) is not None:
            raise ConfigError(f"clip_qkv={cfg.clip_qkv} must be null: remoe does not clip "
                              "queries, keys and values")
        return dict(experts=cfg.num_experts, width=cfg.intermediate_size,
                    normalize=bool(cfg.norm_topk_prob), qkv_bias=False, qk_norm=True, shared=0)
    raise ConfigError(f"SRC model_type={kind!r} must be one of {', '.join(SOURCES)}")


def expert_state(hf_sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}.mlp."
    if p + "experts.gate_up_proj" not in hf_sd:
        raise ConfigError("the source's experts must be fused (experts.gate_up_proj): load it "
                          "with transformers >= 5")
    return {f"layers.{i}.ffn.experts.w_in_ND2H": hf_sd[p + "experts.gate_up_proj"].transpose(1, 2),
            f"layers.{i}.ffn.experts.w_out_NHD": hf_sd[p + "experts.down_proj"].transpose(1, 2)}


def shared_expert_state(hf_sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Qwen2-MoE's shared expert and its gate of layer ``i``, under our names."""
    p, q = f"model.layers.{i}.mlp.", f"layers.{i}.ffn.shared_expert."
    out = {f"{q}ffn.{ours}.weight": hf_sd[f"{p}shared_expert.{hf}.weight"]
           for hf, ours in _SHARED.items()}
    out[q + "gate.weight"] = hf_sd[p + "shared_expert_gate.weight"]
    return out


def check_source(cfg: Any) -> None:
    """Raise the one-line reason why a source config cannot be converted (before any weight
    is loaded)."""
    if cfg.model_type in UNSUPPORTED:
        raise ConfigError(f"SRC model_type={cfg.model_type!r} cannot be converted: "
                          f"{UNSUPPORTED[cfg.model_type]}")
    fam = _family(cfg)
    backbone.backbone_kwargs(cfg, qkv_bias=fam["qkv_bias"], qk_norm=fam["qk_norm"])


def relu_router_from_softmax(w_ND: torch.Tensor) -> torch.Tensor:
    """``W - mean_e W_e``: the same softmax router, with logits centred per token."""
    return w_ND - w_ND.mean(0, keepdim=True)


def from_hf(hf_model: Any, router: str = "relu", top_k: int | None = None):
    """A ReMoE with the source's backbone and experts and a ``router`` initialised from its
    softmax router (see the module docstring)."""
    from remoe import ReMoEConfig, ReMoEForCausalLM

    cfg = hf_model.config
    check_source(cfg)
    fam = _family(cfg)
    if router not in ROUTERS:
        raise ConfigError(f"--router={router!r} must be one of {', '.join(ROUTERS)}")
    E, k = fam["experts"], top_k or cfg.num_experts_per_tok
    if router == "topk" and k != cfg.num_experts_per_tok:
        raise ConfigError(f"--top-k={k} must equal the source's num_experts_per_tok="
                          f"{cfg.num_experts_per_tok} with --router topk (else not the same model)")
    if not 1 <= k <= E:
        raise ConfigError(f"--top-k={k} must be in [1, num_experts={E}]")
    kw = backbone.backbone_kwargs(cfg, qkv_bias=fam["qkv_bias"], qk_norm=fam["qk_norm"])
    new_cfg = ReMoEConfig(**kw, ffn_hidden_size=fam["width"], router=router,
                          num_experts=E, top_k=k, granularity=1,
                          topk_normalize=router == "topk" and fam["normalize"],
                          shared_expert_size=fam["shared"], shared_expert_gate=True)
    hf_sd = hf_model.state_dict()
    L = kw["num_layers"]
    lmap = backbone.layer_map(fam["qkv_bias"], fam["qk_norm"])
    sd = backbone.hf_backbone_state(hf_sd, L, tied=bool(cfg.tie_word_embeddings), lmap=lmap)
    for i in range(L):
        sd.update(expert_state(hf_sd, i))
        if fam["shared"]:
            sd.update(shared_expert_state(hf_sd, i))
        w = hf_sd[f"model.layers.{i}.mlp.gate.weight"]
        sd[f"layers.{i}.ffn.router.weight"] = relu_router_from_softmax(w) if router == "relu" else w
    model = ReMoEForCausalLM(new_cfg).eval()
    backbone.load_exact(model, sd)
    return model
