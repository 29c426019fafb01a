"""The optimizer side of a step: the learning-rate schedule (linear warm-up, then cosine decay),
AdamW's parameter groups, gradient clipping, the update, stopping when the loss or the gradient
norm becomes non-finite, and when a run stops."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from remoe.rundir.loading import latest_checkpoint


def cosine_lr(step: int, base: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``base`` then cosine decay to ``min_lr`` at ``total`` (0-based step)."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base - min_lr) * (1.0 + math.cos(math.pi * progress))


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


def adamw_kwargs(impl: str, device_type: str) -> dict:
    """``train.adamw_impl`` as AdamW keywords: auto = foreach on CUDA, the single-tensor loop on
    CPU (what remoe always did); fused = one kernel per parameter group."""
    if impl == "auto":
        impl = "foreach" if device_type == "cuda" else "single"
    return {"foreach": impl == "foreach", "fused": True if impl == "fused" else None}


def build_optimizer(model: torch.nn.Module, tc, device_type: str) -> torch.optim.Optimizer:
    """AdamW with ``tc``'s (``train.*``) hyper-parameters and implementation
    (``train.adamw_impl``, :func:`adamw_kwargs`); norms and the routers' weights (whose scale IS
    the routing) get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or ".router." in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                             **adamw_kwargs(tc.adamw_impl, device_type))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(model: torch.nn.Module, clip: float, ep=None) -> float:
    """The global gradient norm before clipping to ``clip`` (no clipping when ``clip <= 0``);
    under expert parallelism the norm covers the replicated grads once and every rank's experts."""
    return float(clip_gradients_on_device(model, clip, ep))


def clip_gradients_on_device(model: torch.nn.Module, clip: float, ep=None) -> torch.Tensor | float:
    """:func:`clip_gradients` without reading the norm back: a device tensor (no host sync; the
    trainer copies it to the host with the step's other numbers). FSDP's clipping returns a float."""
    params = [p for p in model.parameters() if p.grad is not None]
    if ep is not None:
        return ep.clip_grad_norm_(params, clip)
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params])


def _diverged(optimizer: torch.optim.Optimizer, what: str, ckpt_root: Path) -> TrainingDiverged:
    optimizer.zero_grad(set_to_none=True)
    return TrainingDiverged(f"{what}; stopping. Last good checkpoint: "
                            f"{latest_checkpoint(ckpt_root)}")


def check_finite_losses(optimizer: torch.optim.Optimizer, step: int, lm: float, reg: float,
                        aux: float, ckpt_root: Path) -> None:
    """Raise :class:`TrainingDiverged` (dropping the step's gradients) on a non-finite loss."""
    if not all(math.isfinite(v) for v in (lm, reg, aux)):
        raise _diverged(optimizer, f"loss became non-finite at step {step + 1} (lm_loss={lm}, "
                                   f"reg_loss={reg}, aux_loss={aux})", ckpt_root)


def finish_and_clip(model: torch.nn.Module, clip: float, ep=None) -> torch.Tensor | float:
    """Finish the expert-parallel (or FSDP) gradients and clip them; the norm stays on the
    device (see :func:`clip_gradients_on_device`)."""
    if ep is not None:
        ep.finish_grads()  # expert grads: sum over ranks -> mean, as DDP does
    return clip_gradients_on_device(model, clip, ep)


def update(optimizer: torch.optim.Optimizer, grad_norm: float, step: int, ckpt_root: Path) -> None:
    """The optimizer step after :func:`finish_and_clip`, unless the norm is non-finite; zero."""
    if not math.isfinite(grad_norm):
        raise _diverged(optimizer, f"gradient norm became non-finite at step {step + 1}", ckpt_root)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def stop_reason(tc, step: int, tokens: int, flops: float) -> str | None:
    """Why a run with ``train`` section ``tc`` stops after ``step`` steps, ``tokens`` tokens
    and ``flops`` FLOPs (None: it goes on)."""
    if step >= tc.max_steps:
        return f"reached train.max_steps={tc.max_steps}"
    if tc.max_tokens is not None and tokens >= tc.max_tokens:
        return f"reached train.max_tokens={tc.max_tokens}"
    if tc.max_flops is not None and flops >= tc.max_flops:
        return f"reached train.max_flops={tc.max_flops:.3g}"
    return None
