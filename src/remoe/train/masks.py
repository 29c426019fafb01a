"""Routing masks recorded during training: the fixed calibration sequences they are taken on,
and the ``routing/masks_STEP.npz`` files (bit-packed ``[L, T, N]``) ``remoe analyze`` reads,
with the share of the calibration tokens routed to no expert in each layer (``no_expert_share``
``[L]``: the one expert-use number the step's counts cannot give)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from remoe.method.expertuse import no_expert_share_of


def calibration_set(data, seq_len: int, calib_tokens: int) -> torch.Tensor | None:
    """About ``calib_tokens`` tokens of validation sequences, the domains interleaved so that
    every domain is kept (None: no validation data)."""
    n = max(1, math.ceil(calib_tokens / seq_len))  # sequences in the calibration set
    per_domain = max(1, math.ceil(n / max(1, len(data.domains))))
    rows = [ids[:, :seq_len] for ids, _ in data.eval_batches(
        "validation", seq_len=seq_len, batch_size=n, max_chunks_per_domain=per_domain)]
    if not rows:
        return None
    ids = torch.cat(rows)  # domain after domain
    return ids[round_robin(ids.shape[0], per_domain)][:n]


def round_robin(total: int, per_group: int) -> torch.Tensor:
    """Indices visiting consecutive groups of ``per_group`` rows in turn (one row each)."""
    idx = torch.arange(total)
    groups = (total + per_group - 1) // per_group
    key = (idx % per_group) * groups + idx // per_group
    return idx[key.argsort()]


def write_masks(run_dir: Path, step: int, masks: list[torch.Tensor],
                token_ids: torch.Tensor) -> Path:
    """Write one forward's masks (per MoE layer bool ``[T, N]``) atomically; returns the path."""
    masks_LTN = torch.stack([m.cpu() for m in masks]).numpy()
    out_dir = run_dir / "routing"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"masks_{step:07d}.npz"
    tmp = out_dir / f".masks_{step:07d}.tmp.npz"
    np.savez_compressed(tmp, masks=np.packbits(masks_LTN, axis=-1),
                        shape=np.array(masks_LTN.shape),
                        token_ids=token_ids.reshape(-1).numpy(), step=np.array(step),
                        no_expert_share=no_expert_share_of(masks_LTN))
    os.replace(tmp, path)
    return path


@torch.no_grad()
def record_masks(model, calib: torch.Tensor, device, run_dir: Path, step: int, is_main: bool
                 ) -> None:
    """One forward of the calibration set with ``record_masks=True`` (every rank that takes
    part in it: a collective forward under expert parallelism or FSDP); rank 0 writes them."""
    model.eval()
    try:
        out = model(input_ids=calib.to(device), record_masks=True)
        if is_main:
            write_masks(run_dir, step, out.aux.masks, calib)
    finally:
        model.train()
