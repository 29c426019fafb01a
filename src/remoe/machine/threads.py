"""Intra-op thread count of a run: fixed when it starts, recorded, reused on resume.

The policy (``train.num_threads``):

* ``null`` (the default): all usable cores (:func:`usable_cores`: the CPU affinity, capped by
  ``OMP_NUM_THREADS``; never the machine's load). The count is recorded in the run (every
  checkpoint's trainer state, ``threads`` in ``metrics.jsonl``) and a ``--resume`` reuses the
  recorded count, whatever the resuming process would default to.
* ``N``: N threads.
* ``auto``: :class:`ThreadTuner` picks all usable cores or 1 by timing real steps, re-checked
  every ``train.thread_probe_every`` steps. Faster beside busy processes (a 2-thread process
  beside one busy process fell ~10x: its OpenMP barriers wait for a descheduled sibling, while 1
  thread only loses its share of the core), but not bit-reproducible across loads: the count
  then follows the load, and a step's bits may depend on the thread count.

Why fixed by default: a step's numbers are a function of its inputs and of the thread count.
On AMD (AVX2 MKL kernels) the fused experts make 1 and 2 threads give the same bits (small
products run on one thread, ``remoe.model.dispatch.SMALL_MM_ROWS``), but Intel's AVX-512 MKL
kernels give other bits at 2 threads than at 1 (a 4-step micro run differed at step 2 in the
8th digit). With the count fixed, the same config and seed give the same numbers on one machine
whatever runs beside it. :func:`fix_threads` applies the policy for training, evaluation and
analysis alike and prints :func:`load_hint` when other processes load the machine.
"""

from __future__ import annotations

import os
import statistics

import torch


def usable_cores(local_world_size: int = 1) -> int:
    """Cores this process may use: its CPU affinity shared among the local ranks, capped by
    ``OMP_NUM_THREADS`` when that is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    cores = max(1, cores // max(1, local_world_size))
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) >= 1:  # the user's (or launcher's) cap is respected
        cores = min(cores, int(omp))
    return cores


#: what the hint suggests to a training run; eval and analysis suggest OMP_NUM_THREADS=1
TRAIN_FIX = "--set train.num_threads=1 (or OMP_NUM_THREADS=1)"


def load_hint(command: str, threads: int, fix: str = TRAIN_FIX) -> str | None:
    """One line suggesting one thread when the machine is busy and ``threads`` > 1 (a hint
    only: the count stays what the policy chose)."""
    if threads <= 1:
        return None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not Unix
        return None
    if load < 0.75:
        return None
    return (f"{command}: note: load average {load:.1f}: other processes use this machine; "
            f"beside other jobs {fix} runs faster; this one keeps {threads} threads (fixed at its "
            "start, so its numbers do not follow the load)")


def fix_threads(command: str, requested: int | None = None, local_world_size: int = 1,
                hint: bool = True, fix: str = "OMP_NUM_THREADS=1") -> int:
    """Set and return the intra-op thread count of a command: ``requested`` (a recorded or
    configured count) or all usable cores; prints :func:`load_hint` (to stderr) when asked."""
    import sys

    threads = requested if requested else usable_cores(local_world_size)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    line = load_hint(command, threads, fix) if hint else None
    if line:
        print(line, file=sys.stderr, flush=True)
    return threads


class ThreadTuner:
    """Picks the faster of ``candidates`` thread counts by timing real steps, re-checked often."""

    def __init__(self, max_threads: int, probe_every: int = 50, probe_steps: int = 2) -> None:
        self.candidates = sorted({max(1, max_threads), 1}, reverse=True)
        self.probe_every = max(1, probe_every)
        self.probe_steps = max(1, probe_steps)
        self.current = self.candidates[0]
        self._times: dict[int, list[float]] = {}
        self.decisions: list[tuple[int, int]] = []  # (step, threads chosen)

    @property
    def active(self) -> bool:
        return len(self.candidates) > 1

    def _slot(self, step: int) -> int | None:
        """During a probe window, the candidate index timed at ``step`` (None: exploit)."""
        offset = step % self.probe_every
        window = self.probe_steps * len(self.candidates)
        # the first step of a run (and of a resume) is skipped: it pays one-off warm-up costs
        offset -= 1
        if offset < 0 or offset >= window:
            return None
        return offset // self.probe_steps

    def before_step(self, step: int) -> int:
        """Set the thread count for optimizer step ``step`` (0-based); returns it."""
        if self.active:
            slot = self._slot(step)
            want = self.candidates[slot] if slot is not None else self.current
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        return torch.get_num_threads()

    def after_step(self, step: int, seconds: float) -> None:
        """Record the step's time; at the end of a probe window, keep the faster candidate."""
        if not self.active:
            return
        slot = self._slot(step)
        if slot is None:
            return
        self._times.setdefault(self.candidates[slot], []).append(seconds)
        if slot == len(self.candidates) - 1 and len(self._times[self.candidates[slot]]) >= self.probe_steps:
            best = min(self._times, key=lambda t: statistics.median(self._times[t]))
            if best != self.current or not self.decisions:
                self.decisions.append((step + 1, best))
            self.current = best
            self._times = {}
