"""What a run shows while it trains: a tqdm bar on a terminal, otherwise a progress line every
``train.log_every`` steps and at least every 30 s (step of the total, tokens/s since the previous
line, ETA)."""

from __future__ import annotations

import time
from typing import Any


def stats_text(rec: dict[str, Any]) -> str:
    # lambda only where a controller steers one (a TopK or dense run's is always 0)
    lam = f"lambda {rec['lambda']:.2e}  " if rec.get("lambda") else ""
    return f"lm {rec['lm_loss']:.3f}  S {rec['sparsity']:.3f}  {lam}lr {rec['lr']:.2e}"


def open_progress(name: str, start_step: int, total: int, log_every: int, bar: bool,
                  main: bool):
    """The tqdm bar (``bar``: a terminal on the main rank), else None after announcing the lines."""
    if bar:
        from tqdm import tqdm

        return tqdm(total=total, initial=start_step, desc=name, dynamic_ncols=True)
    if main and log_every:
        print(f"training {name}: steps {start_step + 1}-{total}; a line every {log_every} steps "
              f"or 30 s (tokens/s since the previous line, ETA)", flush=True)
    return None


class ProgressLines:
    """The progress lines of a run without a terminal (e.g. ``remoe train > log 2>&1``)."""

    def __init__(self, total: int, every: int) -> None:
        self.total, self.every = total, every
        self.start: tuple[float, int, int] | None = None  # (wall time, step, tokens) before it
        self.last: tuple[float, int, int] | None = None

    def update(self, rec: dict[str, Any]) -> None:
        now, total = time.monotonic(), self.total
        if self.start is None:
            # the first step of a process carries one-time costs (allocation, lazy
            # initialisation, the thread tuner's first probe): the ETA counts from its end, so
            # it is not the first step's time multiplied by the steps left (that was ~8x high)
            step_s = rec["step_tokens"] / max(rec["tokens_per_s"], 1e-9)
            self.last = (now - step_s, rec["step"] - 1, rec["tokens"] - rec["step_tokens"])
            self.start = (now, rec["step"], rec["tokens"])
        every = self.every
        if not every or not (rec["step"] % every == 0 or rec["step"] in (1, total)
                             or now - self.last[0] >= 30.0):
            return
        t0, _, k0 = self.last
        rate = (rec["tokens"] - k0) / max(now - t0, 1e-9)
        print(f"step {rec['step']:>5}/{total} ({100 * rec['step'] / max(total, 1):3.0f}%)  "
              f"{stats_text(rec)}  {rate:,.0f} tok/s  ETA {self.eta(now, rec['step'])}",
              flush=True)
        self.last = (now, rec["step"], rec["tokens"])

    def eta(self, now: float, step: int) -> str:
        """Time left at the mean step time since the end of this process's first step."""
        ts, ss, _ = self.start
        if step >= self.total:
            return "0m00s"
        if step <= ss:
            return "after warm-up"
        left = (now - ts) / (step - ss) * (self.total - step)
        return f"{int(left // 60)}m{int(left % 60):02d}s"
