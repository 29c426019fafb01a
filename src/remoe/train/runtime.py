"""The process a run trains in: CPU threads, torch.distributed, the device and the precision."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from remoe.machine.threads import ThreadTuner, usable_cores
from remoe.distributed.setup import DistInfo, init_distributed, resolve_device


@dataclass
class Runtime:
    threads: ThreadTuner | None  # None: train.num_threads fixed the thread count
    dist: DistInfo
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: fp32


def setup_runtime(tc) -> Runtime:
    """Threads, process group and device of ``tc`` (the ``train`` section)."""
    threads = None  # train.num_threads=N: fixed; null: chosen by measurement
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = ThreadTuner(usable_cores(local), probe_every=tc.thread_probe_every)
    want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
    info = init_distributed("cuda" if want_cuda else "cpu")
    device = resolve_device(tc.device, info)
    precision = tc.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return Runtime(threads, info, device, torch.bfloat16 if precision == "bf16" else None)
