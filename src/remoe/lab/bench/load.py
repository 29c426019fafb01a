"""``remoe bench --suite load``: the default training run alone and beside one busy process.

For each thread setting (all usable cores, 1 thread, and ``train.num_threads: auto``, the
trainer's opt-in timing :class:`remoe.machine.threads.ThreadTuner`) and each condition (the machine to itself;
one CPU-bound process spinning beside it), a short ``remoe train`` of the default config runs
in its own process, and the median tokens/s of its steps after the tuner's first probe window
is read back from ``metrics.jsonl``. This is the measurement behind the threads default: it
needs a machine with no other load, which the JSON records (load average before each run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remoe.machine.threads import usable_cores

SPINNER = "while True: pass"


def _settings(cores: int) -> list[tuple[str, str]]:
    rows = [(f"{cores} threads (fixed)", str(cores)), ("1 thread (fixed)", "1"),
            ("auto (timed)", "auto")]
    return rows if cores > 1 else rows[1:]


def _train(config: Path | None, threads: str, steps: int, out_dir: Path, name: str,
           allocator: str, data_cache: str | None, extra: list[str] = ()) -> dict:
    sets = {"run.out_dir": str(out_dir), "run.name": name, "train.max_steps": steps,
            "train.eval_every": 0, "train.save_every": 0, "train.log_every": 0,
            "analysis.record_masks_every": 0, "train.num_threads": threads,
            "train.thread_probe_every": 50}
    if data_cache:
        sets["data.cache_dir"] = data_cache
    cmd = [sys.executable, "-m", "remoe.cli", "train", "--no-progress", "--allocator", allocator]
    cmd += [str(config)] if config else []
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for o in extra:  # further overrides (tests: a micro model)
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"remoe train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    recs = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    # steps after the tuner's first probe window (steps 2-5 probe; the first step warms up)
    tail = [r for r in recs if r["step"] > 6] or recs
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in tail),
            "threads_used": sorted({r.get("threads") for r in tail if r.get("threads")}),
            "steps_measured": len(tail), "wall_s": time.perf_counter() - t0}


def run_load(config: Path | None, steps: int = 24, allocator: str = "auto",
             data_cache: str | None = None) -> dict:
    """Tokens/s of the default run per thread setting, alone and beside one busy process."""
    cores = usable_cores()
    rows = []
    with tempfile.TemporaryDirectory(prefix="remoe-bench-load-") as tmp:
        for cond in ("alone", "beside one busy process"):
            spinner = None
            if cond != "alone":
                spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
                time.sleep(1.0)
            try:
                for label, threads in _settings(cores):
                    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
                    name = f"r{len(rows)}"
                    print(f"  {cond:<24} {label:<20} ...", end="", flush=True)
                    r = _train(config, threads, steps, Path(tmp), name, allocator, data_cache)
                    print(f" {r['tokens_per_s']:,.0f} tokens/s (threads {r['threads_used']})",
                          flush=True)
                    rows.append({"condition": cond, "setting": label, "num_threads": threads,
                                 "loadavg_before": load, **r})
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    alone = {r["setting"]: r["tokens_per_s"] for r in rows if r["condition"] == "alone"}
    for r in rows:
        r["vs_alone"] = r["tokens_per_s"] / alone[r["setting"]] if alone.get(r["setting"]) else None
    return {"cores": cores, "steps": steps, "rows": rows}
