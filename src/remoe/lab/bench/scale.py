"""``remoe bench --suite scale``: tokens/s and peak memory per rank of the parallel layouts.

For 1, 2 and 4 gloo processes on this CPU (``torchrun --nproc_per_node=W``), a short
``remoe train`` of the default config (tiny preset) runs in each layout: ``ddp`` (data
parallel), ``fsdp`` (``train.fsdp=true``) and ``fsdp+ep`` (``train.fsdp=true
train.expert_parallel=true``). One process is the same computation in every layout (nothing
is sharded), so it runs once, as the baseline. Every rank keeps the same micro batch and one
thread (weak scaling: W ranks train W times the tokens of one step). Reported per row: tokens/s
of the whole job (median over the steps after the first two, read from ``metrics.jsonl``),
tokens/s per rank, and the peak resident set size of every rank (``ru_maxrss`` of the rank's
process, written by the worker entry point of this module when ``remoe train`` returns).

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

LAYOUTS = {"ddp": [], "fsdp": ["train.fsdp=true"],
           "fsdp+ep": ["train.fsdp=true", "train.expert_parallel=true"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(world: int, layout: str, config: Path | None, steps: int, out_dir: Path,
         extra: list[str]) -> dict:
    name = f"w{world}-{layout.replace('+', '_')}"
    rss_dir = out_dir / f"{name}-rss"
    rss_dir.mkdir(parents=True)
    sets = [f"run.out_dir={out_dir}", f"run.name={name}", f"train.max_steps={steps}",
            "train.eval_every=0", "train.save_every=0", "train.log_every=0",
            "analysis.record_masks_every=0", "train.num_threads=1", *LAYOUTS[layout], *extra]
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
    recs = [json.loads(x) for x in (out_dir / name / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
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
