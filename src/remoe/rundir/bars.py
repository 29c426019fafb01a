"""Progress output is remoe's own: transformers' bars ("Loading weights", "Writing model
shards") are off around the loads and saves remoe makes, and back as they were afterwards
(a notebook keeps its own setting)."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def no_hf_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block (imports transformers: use it around
    a load or save, which needs transformers anyway)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
