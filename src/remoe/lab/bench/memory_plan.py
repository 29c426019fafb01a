"""Memory arithmetic per GPU for the paper's models under each parallel layout (docs/SCALING.md).

Parameter counts come in closed form from a :class:`~remoe.model.config.ReMoEConfig` (tested against
the real model's ``num_parameters``): per decoder block the attention (``2 D^2 + 2 D n_kv d_h``
without biases), two RMSNorm weights and the FFN (dense SwiGLU ``3 D F``; an MoE layer
``E * 3 D F`` of experts, ``E G`` experts of width ``F / G``, plus the ``[E G, D]`` router);
the embedding and the untied LM head ``V D`` each, the final norm ``D``.

Model state per parameter in mixed-precision training: fp32 master weight 4 B + fp32 gradient
4 B + AdamW's two fp32 moments 8 B = 16 B. Per GPU, W GPUs:

* ``ddp``: every GPU holds all of it, ``16 P``.
* ``fsdp``: sharded, ``16 P / W``, plus the unsharded units in flight: the all-gathered bf16
  weights (2 B) and their unsharded gradients (4 B) of one decoder block, counted twice (the
  block computing and the one prefetched): ``12 P_block``.
* ``fsdp+ep`` (W divides E G): experts split by expert parallelism (each GPU holds whole
  experts), the rest sharded by FSDP: the same ``16 P / W`` of state, but only a block's
  non-expert weights are all-gathered: ``12 P_block_non_expert``.

Activations (they scale with the micro batch and the sequence length, and with the routing
stage for ReMoE) are not included.
"""

from __future__ import annotations

from typing import Any

GIB = 1024 ** 3
STATE_BYTES = 16  # fp32 weight + fp32 grad + AdamW m, v
UNIT_BYTES = 12  # 2 units in flight x (bf16 gathered weight 2 B + unsharded grad 4 B)
LAYOUTS = ("ddp", "fsdp", "fsdp+ep")


def param_counts(cfg) -> dict[str, int]:
    """``total``, ``experts``, ``block`` (one decoder block) and ``block_experts`` of ``cfg``."""
    from remoe.model import registry

    b, r = cfg.backbone, cfg.routing
    D, F, V = b.hidden_size, b.ffn_hidden_size, b.vocab_size
    dh = D // b.num_heads
    attn = 2 * D * D + 2 * D * b.num_kv_heads * dh
    if cfg.is_moe:
        N = r.num_routed
        experts = N * 3 * D * (F // r.granularity)
        router = N * D if registry.declares(r.router, "has_router_weights") else 0
        ffn = experts + router
    else:
        experts, ffn = 0, 3 * D * F
    block = attn + 2 * D + ffn
    L = b.num_layers
    return {"total": L * block + 2 * V * D + D, "experts": L * experts, "block": block,
            "block_experts": experts}


def per_gpu(counts: dict[str, int], layout: str, world: int) -> dict[str, float]:
    """Bytes per GPU of model state (``state``), units in flight (``transient``), ``total``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    P = counts["total"]
    if layout == "ddp":
        state, transient = STATE_BYTES * P, 0
    elif layout == "fsdp":
        state, transient = STATE_BYTES * P / world, UNIT_BYTES * counts["block"]
    else:
        state = STATE_BYTES * P / world
        transient = UNIT_BYTES * (counts["block"] - counts["block_experts"])
    return {"state": state, "transient": transient, "total": state + transient}


def plan_rows(presets=("small", "medium", "large"), routers=("dense", "topk", "relu"),
              num_experts: int = 8, worlds=(8, 16, 32)) -> list[dict[str, Any]]:
    """One row per (preset, router, layout, world): parameters and GiB per GPU."""
    from remoe.model.config import ReMoEConfig

    rows = []
    for preset in presets:
        for router in routers:
            extra = {} if router == "dense" else {"num_experts": num_experts}
            cfg = ReMoEConfig.from_preset(preset, router=router, **extra)
            c = param_counts(cfg)
            for world in worlds:
                for layout in LAYOUTS:
                    if layout == "fsdp+ep" and (not cfg.is_moe or
                                                cfg.routing.num_routed % world):
                        continue
                    m = per_gpu(c, layout, world)
                    rows.append({"preset": preset, "router": router, "params": c["total"],
                                 "layout": layout, "gpus": world,
                                 "state_gib": m["state"] / GIB,
                                 "transient_gib": m["transient"] / GIB,
                                 "total_gib": m["total"] / GIB})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| preset | router | params | layout | GPUs | state GiB | in-flight GiB | total GiB |",
           "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['preset']} | {r['router']} | {r['params'] / 1e6:,.0f}M | {r['layout']} "
                   f"| {r['gpus']} | {r['state_gib']:.1f} | {r['transient_gib']:.2f} "
                   f"| {r['total_gib']:.1f} |")
    return "\n".join(out)


if __name__ == "__main__":  # the table of docs/SCALING.md
    print(markdown(plan_rows(worlds=(8,)) + [r for r in plan_rows(worlds=(16,))
                                             if r["preset"] == "large"]))
