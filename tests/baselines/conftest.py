"""The baseline tests run tiny models: one intra-op thread is faster than two on a shared CPU
(OpenMP workers spin when the cores are oversubscribed). Restored after each test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
