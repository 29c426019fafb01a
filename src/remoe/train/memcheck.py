"""A lower bound of a run's memory, checked before any data or model work.

``model.hidden_size=1000000`` or ``train.micro_batch_size=1e9`` used to fail with an allocator
error minutes later (after the data was prepared, or at step 1 with files left behind). The
bound here is deliberately low, so it refuses only what cannot fit: the model state (fp32
weight, gradient and AdamW's two moments, 16 bytes a parameter, sharded over the ranks with
``train.fsdp``) plus the LM head's logits and their gradient for one micro-batch (8 bytes a
logit). Parameters in closed form from the model section (no tensor is made): embedding and
LM head ``V D`` each, attention ``2 D^2 + 2 D n_kv d_h``, FFN ``3 D F`` dense or ``E 3 D F``
for ``E G`` experts of width ``F / G`` plus the ``[E G, D]`` router, norms ``D``.
"""

from __future__ import annotations

import os

from remoe.errors import ConfigError
from remoe.model import registry

GIB = 1024 ** 3


def param_lower_bound(spec) -> int:
    b, r = spec.backbone, spec.routing
    D, L, V = b.hidden_size, b.num_layers, b.vocab_size
    F = b.ffn_hidden_size or 4 * D
    dh = D // max(1, b.num_heads)
    attn = 2 * D * D + 2 * D * b.num_kv_heads * dh
    # a dense FFN kind: one FFN of width F (a lower bound for dense x E too)
    dense = not registry.declares(r.router, "is_moe")
    ffn = 3 * D * F if dense else r.num_experts * 3 * D * F + r.num_routed * D
    return 2 * V * D + L * (attn + ffn + 2 * D) + D


def machine_bytes() -> tuple[int, str]:
    """``(bytes, what)``: the memory this process can use (RAM, capped by a cgroup limit)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "RAM"
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, what = int(text), "memory limit (cgroup)"
        break
    return total, what


def check_fits(cfg) -> None:
    """Refuse (one line) a run whose lower bound exceeds this machine's memory (CPU runs) or
    the GPU's (CUDA runs)."""
    if cfg.train.init_from is not None:
        return  # the model comes from the source (checked when it is read)
    spec = cfg.model_spec(vocab_size=cfg.data.vocab_size)
    params = param_lower_bound(spec)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    state = 16 * params / (world if cfg.train.fsdp else 1)
    logits = 8 * cfg.train.micro_batch_size * cfg.train.seq_len * spec.backbone.vocab_size
    need = state + logits
    device = str(getattr(cfg.train, "device", "auto") or "auto")
    have, what = machine_bytes()
    if device.startswith("cuda") or device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                have = torch.cuda.get_device_properties(0).total_memory
                what = "GPU memory"
        except Exception:  # noqa: BLE001 - no usable CUDA: the CPU bound stands
            pass
    if need > have:
        raise ConfigError(
            f"this run needs at least {need / GIB:,.1f} GiB (model state {state / GIB:,.1f} GiB "
            f"for {params:,} parameters; logits of one micro-batch {logits / GIB:,.1f} GiB) but "
            f"the machine's {what} is {have / GIB:,.1f} GiB: lower model.hidden_size / "
            "model.num_experts / model.num_layers or train.micro_batch_size / train.seq_len")
