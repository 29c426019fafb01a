"""Measurement helpers shared by the suites: interleaved timing, tensor peak memory, machine
facts, fresh measuring processes.

Timing: :func:`time_interleaved` measures alternatives *interleaved in one process* (one call of
each per round, the order rotated every round), repeated, and summarised by their median, so
that a slow period of a shared machine hits every alternative alike (the model suite). The
layer suite calls it with one alternative per process instead (see ``remoe.lab.bench.layer``):
rows that allocate gigabytes per step perturbed the others when they shared a process. Wall
time is the figure of merit; process CPU time (all threads) is kept alongside because it is
less sensitive to other processes.

Peak memory: ``torch.profiler.profile(profile_memory=True)`` records every CPU tensor allocation
and free with its size; the running sum of those events over one step, maximised, is the peak of
*tensor* memory allocated during the step on top of what existed before it (parameters, inputs).
Unlike ``ru_maxrss`` it is exact, per step, and blind to allocator caching and fragmentation.

Fresh processes (:class:`FreshProcesses`): every measurement of ``remoe bench`` runs in a new
process (clean heap, the chosen allocator, this process's thread count), so that no allocator
state carries from one row to the next. Spawning a Python process that imports torch and
transformers takes 10-40 s on a loaded 2-core machine; the robust method (rows x rounds, each in
its own process) would spend most of its time importing. So the processes are *forked* from a
server process (``multiprocessing``'s ``forkserver``) that imported torch, transformers' Mixtral
block and the bench modules once and never ran a torch operation (no OpenMP pool exists to be
broken by the fork). Each child still starts with the server's small import-time heap and
nothing else. The server is started with the allocator's environment (``LD_PRELOAD`` for
tcmalloc) and stopped when the :class:`FreshProcesses` block ends, so two runs with different
allocators never share it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from remoe.machine import allocator as allocators


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
    minutes): its median is then a single measurement. "Took" is the smaller of its wall and
    process CPU time: on a loaded machine wall time is several times the work, and with several
    threads CPU time counts spinning workers.
    """
    names = list(fns)
    first = {}
    for i in range(warmup):
        for n in names:
            c0, w0 = time.process_time(), time.perf_counter()
            fns[n]()
            first.setdefault(n, min(time.perf_counter() - w0, time.process_time() - c0))
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


def _proc_stat_busy_s() -> float | None:
    """Seconds of CPU time spent by the whole machine (all cores, all processes) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OthersMeter:
    """How many cores *other* processes kept busy while a measurement ran.

    ``start()`` / ``stop()`` around the timed calls of one process: the machine's busy CPU
    seconds (``/proc/stat``) minus this process's own CPU seconds, over the wall time. 0 on an
    idle machine, ~1 beside one CPU-bound process; None where ``/proc`` is missing.
    """

    def start(self) -> None:
        self.busy0, self.cpu0, self.wall0 = _proc_stat_busy_s(), time.process_time(), time.perf_counter()

    def stop(self) -> float | None:
        busy1, cpu1, wall1 = _proc_stat_busy_s(), time.process_time(), time.perf_counter()
        if self.busy0 is None or busy1 is None or wall1 <= self.wall0:
            return None
        return round(max(0.0, (busy1 - self.busy0) - (cpu1 - self.cpu0)) / (wall1 - self.wall0), 2)


def _proc_cpu_s(pid: str) -> tuple[str, int, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    # fields after the name: state(0) ... utime(11) stime(12) ... nice(16)
    return name, int(rest[16]), (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def busy_processes(interval_s: float = 1.0, top: int = 6, min_share: float = 0.05) -> list[dict]:
    """The processes that used the most CPU over ``interval_s`` (name, pid, nice, cores used):
    what else ran on the machine while the benchmark did. Empty where ``/proc`` is missing."""
    if not os.path.isdir("/proc"):
        return []
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    before = {p: _proc_cpu_s(p) for p in pids}
    time.sleep(interval_s)
    out = []
    for p, b in before.items():
        a = _proc_cpu_s(p)
        if a is None or b is None:
            continue
        share = (a[2] - b[2]) / interval_s
        if share >= min_share:
            out.append({"pid": int(p), "name": a[0], "nice": a[1], "cores": round(share, 2)})
    out.sort(key=lambda r: -r["cores"])
    return out[:top]


def spread(values: list[float]) -> dict:
    """Median, min, max and the relative half-range ``(max - min) / 2 / median`` of ``values``."""
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return {"median": None, "min": None, "max": None, "rel_halfrange": None, "n": 0}
    med = statistics.median(vals)
    return {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
            "rel_halfrange": (max(vals) - min(vals)) / 2 / med if med else None}


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
        "busy_processes_start": busy_processes(),
    }


PRELOAD = ["torch", "remoe.lab.bench.common", "remoe.lab.bench.layer", "remoe.lab.bench.model",
           "transformers.models.mixtral.modeling_mixtral"]


def _child_call(mode: str, threads: int, modules: str, fn, args, kwargs):
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they happen
    from remoe.model import registry

    registry.import_modules([m for m in modules.split(",") if m], "--router-module")
    allocators.configure(mode, "remoe bench", may_reexec=False)  # the server preloaded tcmalloc
    torch.set_num_threads(threads)
    return fn(*args, **kwargs)


def _stop_server() -> None:
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)
    if stop is not None:  # CPython's forkserver: restarted on next use with the then environment
        stop()


class FreshProcesses:
    """``with FreshProcesses(mode, modules) as run: run(fn, *args, **kwargs)``: the call in a
    fresh process that uses allocator ``mode`` and this process's thread count; returns its
    result. ``modules``: router modules (``--router-module``) each child imports first."""

    def __init__(self, mode: str, modules: list[str] = ()) -> None:
        self.mode, self.modules = mode, ",".join(modules)
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "FreshProcesses":
        env = allocators.child_environment(self.mode)
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the server inherits it (tcmalloc must be preloaded at start)
        _stop_server()  # a server left by an earlier run may have another environment
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        return self

    def __call__(self, fn, *fargs, **fkwargs):
        sys.stdout.flush()
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=self.ctx) as pool:
            return pool.submit(_child_call, self.mode, torch.get_num_threads(), self.modules, fn,
                               fargs, fkwargs).result()

    def __exit__(self, *exc) -> None:
        _stop_server()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
