"""Measurement helpers shared by the suites: interleaved timing, tensor peak memory, machine facts.

Timing: :func:`time_interleaved` measures alternatives *interleaved in one process* (one call of
each per round, the order rotated every round), repeated, and summarised by their median, so
that a slow period of a shared machine hits every alternative alike (the model suite). The
layer suite calls it with one alternative per process instead (see ``remoe.bench.layer``):
rows that allocate gigabytes per step perturbed the others when they shared a process. Wall
time is the figure of merit; process CPU time (all threads) is kept alongside because it is
less sensitive to other processes.

Peak memory: ``torch.profiler.profile(profile_memory=True)`` records every CPU tensor allocation
and free with its size; the running sum of those events over one step, maximised, is the peak of
*tensor* memory allocated during the step on top of what existed before it (parameters, inputs).
Unlike ``ru_maxrss`` it is exact, per step, and blind to allocator caching and fragmentation.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Samples:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_s) if self.wall_s else float("nan")

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_s) if self.cpu_s else float("nan")

    def as_dict(self) -> dict:
        return {"wall_ms": 1e3 * self.wall, "cpu_ms": 1e3 * self.cpu,
                "wall_ms_samples": [round(1e3 * s, 3) for s in self.wall_s]}


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                     slow_s: float = 20.0) -> dict[str, Samples]:
    """Median-ready samples of each callable, measured round-robin (order rotated per round).

    Each sample is one call. A callable whose warm-up call took longer than ``slow_s`` seconds
    is sampled in the first round only (it is far off the others; more rounds would only burn
    minutes): its median is then a single measurement.
    """
    names = list(fns)
    first = {}
    for i in range(warmup):
        for n in names:
            w0 = time.perf_counter()
            fns[n]()
            first.setdefault(n, time.perf_counter() - w0)
    out = {n: Samples() for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if r > 0 and first.get(n, 0.0) > slow_s:
                continue
            c0, w0 = time.process_time(), time.perf_counter()
            fns[n]()
            w1, c1 = time.perf_counter(), time.process_time()
            out[n].wall_s.append(w1 - w0)
            out[n].cpu_s.append(c1 - c0)
    return out


#: Kineto (the profiler behind ``torch.profiler``) logs every profiler start and stop at its
#: ``USDT`` level (5) on stderr: two lines per memory measurement. Level 6 is above every
#: message level; the collected events are the same. A value the user set is left alone.
KINETO_QUIET_LEVEL = "6"


def peak_tensor_memory(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensor memory allocated during ``fn()`` above its starting level."""
    from torch.profiler import ProfilerActivity, profile

    quiet = "KINETO_LOG_LEVEL" not in os.environ
    if quiet:  # kineto reads the level when a profile starts
        os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        if quiet:
            os.environ.pop("KINETO_LOG_LEVEL", None)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_cores() -> int | None:
    try:
        with open("/proc/cpuinfo") as f:
            ids = {line.split(":", 1)[1].strip() for line in f if line.startswith("core id")}
        return len(ids) or None
    except OSError:
        return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(allocator: str | None = None) -> dict:
    """What the numbers depend on: CPU, cores, threads, library versions, allocator, load."""
    import transformers

    return {
        "cpu_model": _cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_physical": _physical_cores(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "allocator": allocator or os.environ.get("LD_PRELOAD") or "system malloc, default",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_start": loadavg(),
    }


def matmul_ceiling(quick: bool = False, reps: int = 5) -> dict:
    """Measured fp32 ``torch.mm`` FLOP/s: the best median over a few square and FFN-like shapes."""
    shapes = [(512, 512, 512)] if quick else [(1024, 1024, 1024), (2048, 2048, 2048),
                                               (4096, 256, 2048), (4096, 1024, 256)]
    rows = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        s = time_interleaved({"mm": lambda: torch.mm(a, b, out=out)}, reps=2 if quick else reps)["mm"]
        rows.append({"m": m, "k": k, "n": n, "gflops": 2 * m * k * n / s.wall / 1e9,
                     "gflops_per_cpu_s": 2 * m * k * n / s.cpu / 1e9})
    return {"matmul_fp32_gflops": max(r["gflops"] for r in rows),
            # FLOPs per second of process CPU time: the ceiling of one busy core when 1 thread
            "matmul_fp32_gflops_per_cpu_s": max(r["gflops_per_cpu_s"] for r in rows),
            "shapes": rows}
