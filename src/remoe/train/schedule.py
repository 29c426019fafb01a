"""The learning-rate schedule (linear warm-up, then cosine decay) and when a run stops."""

from __future__ import annotations

import math


def cosine_lr(step: int, base: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``base`` then cosine decay to ``min_lr`` at ``total`` (0-based step)."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base - min_lr) * (1.0 + math.cos(math.pi * progress))


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
