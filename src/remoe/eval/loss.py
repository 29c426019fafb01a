"""The held-out loss moved to the neutral :mod:`remoe.losses` (the trainer's validation and
``remoe eval`` share it without importing each other); this path keeps working."""

from remoe.losses import evaluate_loss  # noqa: F401
