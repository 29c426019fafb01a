"""The learning-rate schedule: linear warm-up, then cosine decay."""

from __future__ import annotations

import math


def cosine_lr(step: int, base: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``base`` then cosine decay to ``min_lr`` at ``total`` (0-based step)."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (base - min_lr) * (1.0 + math.cos(math.pi * progress))
