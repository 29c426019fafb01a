"""The process a run trains in: CPU threads, torch.distributed, the device and the precision."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from remoe import rundir
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


def settle_threads(rt: Runtime, tc, state: dict | None, is_main: bool) -> None:
    """The run's thread count, fixed in ``rt.num_threads``: a resume under
    ``train.num_threads: null`` reuses the count the run recorded (its checkpoint's, else its
    last metrics line's), so the resumed steps compute what the uninterrupted run would have;
    then the load hint (rank 0, on CPU: on a GPU the host threads do not set the speed).
    Nothing to do under ``train.num_threads=auto`` (timed)."""
    if rt.threads is not None:
        return
    recorded = None
    if state is not None and tc.num_threads is None:
        recorded = state.get("num_threads") or (state.get("last_record") or {}).get("threads")
    want = recorded if isinstance(recorded, int) and recorded >= 1 else rt.num_threads
    if recorded is not None and recorded != rt.num_threads and is_main:
        rundir.say(f"--resume: {want} threads, as the run recorded (this process would "
                   f"use {rt.num_threads})")
    rt.num_threads = fix_threads("remoe train", want, hint=is_main and rt.device.type == "cpu",
                                 fix="--set train.num_threads=1 (or OMP_NUM_THREADS=1)")


def prepare_run_data(data_cfg, is_main: bool, progress: bool, barrier):
    """The run's data: rank 0 builds (or opens) the cache, then the other ranks open it."""
    from remoe.data import prepare_data

    data = prepare_data(data_cfg, progress=progress) if is_main else None
    barrier()
    data = data if is_main else prepare_data(data_cfg, progress=False)
    # the model's vocabulary is >= the tokenizer's (checked where the model is made): a store
    # with a larger id (a pre-tokenised source of another tokenizer) stops here, not mid-step
    data.check_vocabulary(data.vocab_size, "the tokenizer's vocabulary")
    return data
