"""Router swap: a transformers Mixtral becomes a ReMoE with its experts kept (``remoe convert
from-hf``), so an existing MoE can be trained further with ReLU routing.

Mapping (per layer; Mixtral's fused expert tensors of transformers >= 5):
``experts.gate_up_proj[e]`` ``[2F, D]`` -> ``w_in_ND2H[e] = gate_up_proj[e]^T`` ``[D, 2F]``
(gate first on both sides); ``experts.down_proj[e]`` ``[D, F]`` -> ``w_out_NHD[e]``
``[F, D]``; ``gate.weight`` ``[E, D]`` -> ``router.weight`` ``[E, D]``; the backbone through
:mod:`remoe.convert.backbone`.

Router: ``--router topk`` keeps Mixtral's function exactly (softmax, top-k, gates
renormalised to sum to 1: ``topk_normalize=true``, same W, same k). ``--router relu`` (the
default) initialises ReLU(x W') from the softmax router with ``W' = W - mean_e W_e``: the
softmax is unchanged by subtracting the same vector from every row, so W' is the same softmax
router, but its logits are centred per token, so ReLU(x W') keeps the experts whose logit is
above the token's mean logit -- the experts the softmax ranks highest -- with gates equal to
that margin. What changes in the function: the number of active experts per token is no longer
fixed at k (about half of the experts pass at first) and the gates are unnormalised logit
margins instead of probabilities summing to 1, so the converted model is not the Mixtral
function; ReMoE's L1 control then steers it to the target sparsity 1 - k/E while it trains.

Qwen2-MoE (shared expert, q/k/v biases) and OLMoE (q/k RMSNorm) have parts remoe's layer does
not, so they are refused with that reason.
"""

from __future__ import annotations

from typing import Any

import torch

from remoe.convert import backbone
from remoe.errors import ConfigError

ROUTERS = ("relu", "topk")
#: model types we know and cannot convert losslessly, with the reason
UNSUPPORTED = {
    "qwen2_moe": "Qwen2-MoE has a shared expert with its own gate and q/k/v biases, which "
                 "remoe's MoE layer and attention do not have",
    "olmoe": "OLMoE normalises queries and keys (q_norm/k_norm), which remoe's attention does not",
}


def expert_state(hf_sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}.mlp."
    if p + "experts.gate_up_proj" not in hf_sd:
        raise ConfigError("the Mixtral experts must be fused (experts.gate_up_proj): load the "
                          "source with transformers >= 5")
    return {f"layers.{i}.ffn.experts.w_in_ND2H": hf_sd[p + "experts.gate_up_proj"].transpose(1, 2),
            f"layers.{i}.ffn.experts.w_out_NHD": hf_sd[p + "experts.down_proj"].transpose(1, 2)}


def relu_router_from_softmax(w_ND: torch.Tensor) -> torch.Tensor:
    """``W - mean_e W_e``: the same softmax router, with logits centred per token."""
    return w_ND - w_ND.mean(0, keepdim=True)


def from_hf(hf_model: Any, router: str = "relu", top_k: int | None = None):
    """A ReMoE with the Mixtral's backbone and experts and a ``router`` initialised from its
    softmax router (see the module docstring)."""
    from remoe import ReMoEConfig, ReMoEForCausalLM

    cfg = hf_model.config
    if cfg.model_type in UNSUPPORTED:
        raise ConfigError(f"SRC model_type={cfg.model_type!r} cannot be converted: "
                          f"{UNSUPPORTED[cfg.model_type]}")
    if cfg.model_type != "mixtral":
        raise ConfigError(f"SRC model_type={cfg.model_type!r} must be 'mixtral'")
    if router not in ROUTERS:
        raise ConfigError(f"--router={router!r} must be one of {', '.join(ROUTERS)}")
    E, k = cfg.num_local_experts, top_k or cfg.num_experts_per_tok
    if router == "topk" and k != cfg.num_experts_per_tok:
        raise ConfigError(f"--top-k={k} must equal the source's num_experts_per_tok="
                          f"{cfg.num_experts_per_tok} with --router topk (else not the same model)")
    kw = backbone.backbone_kwargs(cfg)
    new_cfg = ReMoEConfig(**kw, ffn_hidden_size=cfg.intermediate_size, router=router,
                          num_experts=E, top_k=k, granularity=1,
                          topk_normalize=router == "topk")
    hf_sd = hf_model.state_dict()
    L = kw["num_layers"]
    sd = backbone.hf_backbone_state(hf_sd, L, tied=bool(cfg.tie_word_embeddings))
    for i in range(L):
        sd.update(expert_state(hf_sd, i))
        w = hf_sd[f"model.layers.{i}.mlp.gate.weight"]
        sd[f"layers.{i}.ffn.router.weight"] = relu_router_from_softmax(w) if router == "relu" else w
    model = ReMoEForCausalLM(new_cfg).eval()
    backbone.load_exact(model, sd)
    return model
