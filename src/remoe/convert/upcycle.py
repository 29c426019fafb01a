"""Sparse upcycling: a dense SwiGLU model becomes an E-expert ReMoE (``remoe convert upcycle``).

Every expert of every layer is a copy of that layer's dense FFN; attention, norms, embeddings
and the LM head are copied; each layer gets a fresh ReLU router (normal, ``init_std``).
Layout: the dense ``w_gate`` / ``w_up`` ``[F, D]`` become ``w_in_ND2H[e] = [w_gate^T | w_up^T]``
``[D, 2F]`` (gate first, as :class:`remoe.model.experts.SwiGLUExperts` splits it) and
``w_down`` ``[D, F]`` becomes ``w_out_NHD[e] = w_down^T`` ``[F, D]``.
So a token whose gates sum to 1 gets exactly the dense FFN's output; the ReLU router's gates
do not sum to 1 (at initialisation they are small), so the upcycled model starts as a damped
copy of the dense one and training recovers the scale (docs/CONVERT.md).
"""

from __future__ import annotations

from typing import Any

import torch

from remoe.convert import backbone
from remoe.errors import ConfigError

#: config keys of a saved remoe config.json that describe the file, not the model
_FILE_KEYS = ("auto_map", "architectures", "_name_or_path", "transformers_version", "model_type")


def stack_experts(w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor, w_down_DF: torch.Tensor,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_in_ND2H, w_out_NHD)``: ``num_experts`` copies of one dense SwiGLU."""
    w_in_D2F = torch.cat([w_gate_FD.t(), w_up_FD.t()], dim=1)
    return (w_in_D2F.unsqueeze(0).repeat(num_experts, 1, 1).contiguous(),
            w_down_DF.t().unsqueeze(0).repeat(num_experts, 1, 1).contiguous())


def _moe_config(base: dict[str, Any], experts: int, top_k: int):
    from remoe import ReMoEConfig

    d = {k: v for k, v in base.items() if k not in _FILE_KEYS}
    d.update(router="relu", num_experts=experts, moe_top_k=top_k, granularity=1)
    d.pop("top_k", None)
    return ReMoEConfig(**d)


def upcycle_state(backbone_sd: dict[str, torch.Tensor], dense_ffns: list[tuple], experts: int
                  ) -> dict[str, torch.Tensor]:
    """The full state of the upcycled model but its routers."""
    sd = dict(backbone_sd)
    for i, (g, u, dn) in enumerate(dense_ffns):
        sd[f"layers.{i}.ffn.experts.w_in_ND2H"], sd[f"layers.{i}.ffn.experts.w_out_NHD"] = \
            stack_experts(g, u, dn, experts)
    return sd


def upcycle(src_model: Any, experts: int, top_k: int = 1, seed: int = 0):
    """An E-expert ReLU ReMoE from a dense remoe model (``router=dense``) or a transformers
    ``LlamaForCausalLM`` (checked by :func:`remoe.convert.backbone.backbone_kwargs`)."""
    from remoe import ReMoEForCausalLM

    if not (isinstance(experts, int) and experts >= 1):
        raise ConfigError(f"--experts={experts!r} must be a positive integer")
    if not (isinstance(top_k, int) and 1 <= top_k <= experts):
        raise ConfigError(f"--top-k={top_k!r} must be an integer in [1, --experts={experts}]")
    cfg = src_model.config
    if cfg.model_type == "remoe":
        if cfg.routing.router != "dense":
            raise ConfigError(f"SRC router={cfg.routing.router!r} must be 'dense' to upcycle")
        L = cfg.backbone.num_layers
        src_sd = src_model.state_dict()
        bb = {k: v for k, v in src_sd.items() if ".ffn.ffn." not in k}
        ffns = [tuple(src_sd[f"layers.{i}.ffn.ffn.{n}.weight"]
                      for n in ("w_gate", "w_up", "w_down")) for i in range(L)]
        new_cfg = _moe_config(cfg.to_dict(), experts, top_k)
    elif cfg.model_type == "llama":
        kw = backbone.backbone_kwargs(cfg)
        kw["ffn_hidden_size"] = cfg.intermediate_size
        L = kw["num_layers"]
        src_sd = src_model.state_dict()
        bb = backbone.hf_backbone_state(src_sd, L, tied=bool(cfg.tie_word_embeddings))
        ffns = [tuple(src_sd[f"model.layers.{i}.mlp.{n}_proj.weight"]
                      for n in ("gate", "up", "down")) for i in range(L)]
        new_cfg = _moe_config(kw, experts, top_k)
    else:
        raise ConfigError(f"SRC model_type={cfg.model_type!r} must be 'remoe' (router=dense) "
                          "or 'llama'")
    torch.manual_seed(seed)
    model = ReMoEForCausalLM(new_cfg).eval()
    routers = tuple(f"layers.{i}.ffn.router." for i in range(L))
    backbone.load_exact(model, upcycle_state(bb, ffns, experts), ignore=routers)
    return model
