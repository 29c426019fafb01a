"""``expert_backend="measured"``: pick the faster expert backend per shape by timing it, once.

Opt-in. The candidates (``fused`` and ``grouped_mm``) compute the same function but not the same
floating-point numbers: ``fused`` multiplies the gate into the ``[R, H]`` activations before the
down projection, ``grouped_mm`` into the ``[P, D]`` outputs after it, and their GEMMs are cut
differently. In fp32 they agree to ~1e-6 relative (``tests/model/test_autotune.py`` checks
1e-5 on outputs and gradients); a run that uses ``measured`` is therefore not bit-for-bit
reproducible against ``auto`` (= ``fused`` on CPU, the default, which it never replaces), nor
against itself on a machine where the timing picks differently.

The shape key is (device, dtype, threads, N, D, H, grad or not, P rounded to a power of
sqrt(2)): ReMoE's number of active pairs P varies every step, so nearby values share one
measurement; over a run only a handful of keys are ever measured (stage I -> III). A decision
is kept in memory by the :class:`BackendTuner` of each expert module and in a JSON file shared
by every layer and run (:func:`default_cache_path`), so it is measured once per machine and
shape, never every step. Timing: one warm-up, then ``reps`` calls of each candidate in rotated
order, on the layer's real inputs (forward and, when gradients are on, backward on detached
copies); process CPU time at one thread, wall time otherwise; median.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

CANDIDATES = ("fused", "grouped_mm")


def default_cache_path() -> Path:
    """``$REMOE_CACHE_DIR/expert_backend.json``, else ``$XDG_CACHE_HOME/remoe/...``,
    else ``~/.cache/remoe/expert_backend.json``."""
    root = os.environ.get("REMOE_CACHE_DIR")
    if root:
        return Path(root) / "expert_backend.json"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "remoe" / "expert_backend.json"


def shape_key(x: torch.Tensor, num_experts: int, d_expert: int, pairs: int, grad: bool) -> str:
    bucket = round(2 * math.log2(max(pairs, 1)))  # powers of sqrt(2)
    return (f"{x.device.type}|{str(x.dtype).removeprefix('torch.')}|threads="
            f"{torch.get_num_threads()}|N={num_experts}|D={x.shape[-1]}|H={d_expert}|"
            f"P~2^{bucket / 2:g}|{'train' if grad else 'infer'}")


class BackendTuner:
    """Per-shape backend decisions of one expert module: memory first, then the cache file."""

    def __init__(self, cache_path: Path | None = None, reps: int = 3) -> None:
        self.cache_path = cache_path
        self.reps = reps
        self.decisions: dict[str, dict] = {}

    def _path(self) -> Path:
        return self.cache_path or default_cache_path()

    def _read(self) -> dict:
        try:
            return json.loads(self._path().read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, key: str, record: dict) -> None:
        path = self._path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read()
            data[key] = record
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".expert_backend.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)  # atomic: concurrent layers/runs never read a torn file
        except OSError:
            pass  # a read-only home: the in-memory decision still holds for this process

    def choose(self, key: str, run: Callable[[str], None]) -> str:
        """The backend for ``key``; measures ``run(backend)`` for each candidate when unknown."""
        if key not in self.decisions:
            cached = self._read().get(key)
            if cached and cached.get("backend") in CANDIDATES:
                self.decisions[key] = cached
            else:
                self.decisions[key] = measure(run, self.reps)
                self._write(key, self.decisions[key])
        return self.decisions[key]["backend"]

    def state_dict(self) -> dict:
        return {"decisions": dict(self.decisions)}

    def load_state_dict(self, state: dict) -> None:
        self.decisions = dict(state.get("decisions", {}))


def measure(run: Callable[[str], None], reps: int = 3) -> dict:
    """Time ``run(backend)`` for every candidate (rotated order); the fastest wins."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    samples: dict[str, list[float]] = {b: [] for b in CANDIDATES}
    for b in CANDIDATES:
        run(b)  # warm-up
    for r in range(reps):
        for b in CANDIDATES[r % 2:] + CANDIDATES[:r % 2]:
            t0 = clock()
            run(b)
            samples[b].append(clock() - t0)
    ms = {b: 1e3 * statistics.median(s) for b, s in samples.items()}
    return {"backend": min(ms, key=ms.get), "ms": {b: round(v, 3) for b, v in ms.items()},
            "clock": "cpu" if clock is time.process_time else "wall"}
