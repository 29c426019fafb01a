"""The process a run trains in: CPU threads, torch.distributed, the device and the precision."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from remoe.machine.threads import ThreadTuner, fix_threads, usable_cores
from remoe.distributed.setup import DistInfo, init_distributed, resolve_device


@dataclass
class Runtime:
    threads: ThreadTuner | None  # the timing tuner (train.num_threads=auto only)
    num_threads: int | None  # the fixed count (None: auto); a resume may replace it (recorded)
    dist: DistInfo
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: fp32


def setup_runtime(tc) -> Runtime:
    """Threads, process group and device of ``tc`` (the ``train`` section)."""
    # null: all usable cores, N: N (remoe.machine.threads; the trainer reuses a resumed run's
    # recorded count and prints the load hint once it knows the count); auto: timed
    threads, fixed = None, None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if tc.num_threads == "auto":
        threads = ThreadTuner(usable_cores(local), probe_every=tc.thread_probe_every)
    else:
        fixed = fix_threads("remoe train", tc.num_threads, local, hint=False)
    want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
    info = init_distributed("cuda" if want_cuda else "cpu")
    device = resolve_device(tc.device, info)
    precision = tc.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return Runtime(threads, fixed, info, device,
                   torch.bfloat16 if precision == "bf16" else None)
