"""Intra-op thread count chosen by measurement, so training survives a machine that is shared.

Why: torch's CPU kernels run OpenMP parallel regions that end in a barrier. When another busy
process shares a core, the thread on that core is descheduled for a whole scheduler slice while
its siblings wait at the barrier, and a step made of hundreds of small parallel regions pays
that wait hundreds of times: the default run fell from ~2,100 to ~180 tokens/s at 2 threads
beside one busy process (issue 15), while 1 thread only loses its share of the core.

``ThreadTuner`` (``train.num_threads: null``, the default) therefore measures instead of
guessing: every ``probe_every`` optimizer steps it times ``probe_steps`` steps with each
candidate thread count (all usable cores, and 1) and keeps the faster one until the next probe.
The probes cost a few steps at the slower setting; a fixed ``train.num_threads=N`` turns it off.
The results of a step do not depend on the thread count, so tuning never changes the numbers:
MKL's sgemm does give other bits at 2 threads than at 1 for products over a few rows (an expert
that received 5-11 tokens, issue 29), and the fused experts run those on one thread
(``remoe.model.fused_cpu.SMALL_MM_ROWS``); tests/reliability/test_thread_count.py trains at 1 and 2
threads and resumes at another count, bit for bit.
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
