"""``remoe bench --suite load`` and ``--suite scale``: short ``remoe train`` runs of the default
config, each in child processes, tokens/s read back from their ``metrics.jsonl``.

Load, the default training run alone and beside one busy process: for each thread setting (all
usable cores, 1 thread, and ``train.num_threads: auto``, the trainer's opt-in timing
:class:`remoe.machine.threads.ThreadTuner`) and each condition (the machine to itself; one
CPU-bound process spinning beside it), the median tokens/s of the run's steps after the tuner's
first probe window. This is the measurement behind the threads default: it needs a machine with
no other load, which the JSON records (load average before each run).

Scale, tokens/s and peak memory per rank of the parallel layouts: for 1, 2 and 4 gloo processes
on this CPU (``torchrun --nproc_per_node=W``), the default config (tiny preset) runs in each
layout: ``ddp`` (data parallel), ``fsdp`` (``train.fsdp=true``) and ``fsdp+ep`` (``train.fsdp=true
train.expert_parallel=true``). One process is the same computation in every layout (nothing
is sharded), so it runs once, as the baseline. Every rank keeps the same micro batch and one
thread (weak scaling: W ranks train W times the tokens of one step). Reported per row: tokens/s
of the whole job (median over the steps after the first two), tokens/s per rank, and the peak
resident set size of every rank (``ru_maxrss`` of the rank's process, written by the worker
entry point of this module when ``remoe train`` returns).

Run as a module, this file is that worker: ``python -m remoe.lab.bench.scale RSS_DIR <remoe
arguments>`` runs ``remoe <arguments>`` and writes ``RSS_DIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remoe.machine.threads import usable_cores

LAYOUTS = {"ddp": [], "fsdp": ["train.fsdp=true"],
           "fsdp+ep": ["train.fsdp=true", "train.expert_parallel=true"]}
SPINNER = "while True: pass"


def _train_sets(out_dir: Path, name: str, steps: int, threads) -> list[str]:
    """The ``--set``s of a short, quiet ``remoe train``: no evaluation, checkpoint, log line or
    routing masks."""
    return [f"run.out_dir={out_dir}", f"run.name={name}", f"train.max_steps={steps}",
            "train.eval_every=0", "train.save_every=0", "train.log_every=0",
            "analysis.record_masks_every=0", f"train.num_threads={threads}"]


def _metrics(out_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()
            if x.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(world: int, layout: str, config: Path | None, steps: int, out_dir: Path,
         extra: list[str]) -> dict:
    name = f"w{world}-{layout.replace('+', '_')}"
    rss_dir = out_dir / f"{name}-rss"
    rss_dir.mkdir(parents=True)
    sets = [*_train_sets(out_dir, name, steps, 1), *LAYOUTS[layout], *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           f"--master_port={_free_port()}", "-m", "remoe.lab.bench.scale", str(rss_dir),
           "train", "--no-progress"] + ([str(config)] if config else [])
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: remoe train failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    recs = _metrics(out_dir, name)
    tail = [r for r in recs if r["step"] > 2] or recs  # the first steps warm up
    tps = statistics.median(r["tokens_per_s"] for r in tail)
    rss = [json.loads((rss_dir / f"rank{r}.json").read_text())["peak_rss_mb"]
           for r in range(world)]
    return {"world": world, "layout": layout if world > 1 else "1 process (none sharded)",
            "tokens_per_s": tps, "tokens_per_s_per_rank": tps / world,
            "step_tokens": recs[-1]["step_tokens"], "peak_rss_mb": rss,
            "peak_rss_mb_max": max(rss), "steps_measured": len(tail),
            "wall_s": time.perf_counter() - t0}


def run_scale(config: Path | None, worlds=(1, 2, 4), layouts=tuple(LAYOUTS), steps: int = 8,
              extra: list[str] = ()) -> dict:
    """Every (world size, layout) row; world size 1 once. ``extra``: further ``--set``s."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="remoe-scale-") as tmp:
        for world in worlds:
            for layout in (layouts[:1] if world == 1 else layouts):
                load = os.getloadavg()[0]
                row = run_layout(world, layout, config, steps, Path(tmp), list(extra))
                row["loadavg_before"] = round(load, 2)
                rows.append(row)
    return {"rows": rows, "steps": steps, "threads_per_rank": 1, "backend": "gloo (CPU)",
            "method": "weak scaling: the same micro batch per rank; tokens/s of the whole job, "
                      "median over steps > 2; peak RSS = ru_maxrss of each rank's process"}


def _settings(cores: int) -> list[tuple[str, str]]:
    rows = [(f"{cores} threads (fixed)", str(cores)), ("1 thread (fixed)", "1"),
            ("auto (timed)", "auto")]
    return rows if cores > 1 else rows[1:]


def _train(config: Path | None, threads: str, steps: int, out_dir: Path, name: str,
           allocator: str, data_cache: str | None, extra: list[str] = ()) -> dict:
    sets = _train_sets(out_dir, name, steps, threads) + ["train.thread_probe_every=50"]
    sets += [f"data.cache_dir={data_cache}"] if data_cache else []
    cmd = [sys.executable, "-m", "remoe.cli", "train", "--no-progress", "--allocator", allocator]
    cmd += [str(config)] if config else []
    cmd += [a for s in [*sets, *extra] for a in ("--set", s)]  # extra: tests' micro model
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"remoe train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    recs = _metrics(out_dir, name)
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


def _worker(argv: list[str]) -> int:
    from remoe.cli import main

    rss_dir = Path(argv[0])
    try:
        return main(argv[1:])
    finally:
        rank = int(os.environ.get("RANK", "0"))
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        (rss_dir / f"rank{rank}.json").write_text(json.dumps({"peak_rss_mb": peak_kb / 1024}))


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
