"""Offline mode for everything the evaluation touches: nothing may be downloaded.

The Hugging Face libraries read ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` when they are first
imported, and ``import remoe`` already imports transformers (hence huggingface_hub), so setting
the environment is not enough: :func:`force_offline` also flips the flags of the modules that
are already loaded.
"""

from __future__ import annotations

import os
import sys

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_EVALUATE_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def force_offline() -> None:
    """Put huggingface_hub, datasets and transformers into offline mode (idempotent)."""
    os.environ.update(OFFLINE_ENV)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    ds = sys.modules.get("datasets.config")
    if ds is not None:
        ds.HF_HUB_OFFLINE = True
        ds.HF_DATASETS_OFFLINE = True
