"""``scripts/gpu_check.sh``: the whole GPU measurement in one command, stage by stage.

Runs from a source checkout with the machine's own ``python3`` (``PYTHONPATH=src``, nothing
installed; no zstandard, no lm-eval, no internet: synthetic token batches). Stages, in order
of what matters if the run is cut off:

1. ``env``: Python / torch / CUDA / triton / transformers versions, the device, its
   data-sheet bf16 peak (:data:`remoe.lab.bench.gpu.PEAK_BF16_TFLOPS`) and a measured bf16 matmul;
2. ``bf16_check``: bf16 autocast vs fp32 loss and gradient (:func:`remoe.lab.bench.gpu.loss_check`);
3. one stage per row of :data:`ROWS`: dense / TopK / ReLU at the ``small`` preset (E=8, k=1,
   sequence 1024, ReLU calibrated to the sparse stage III), eager then with each decoder block
   compiled (inductor), all on the default exact dispatch plan (one ``nonzero`` sync per ReLU
   layer), then ReLU on the static plan (padded, no sync: ``train.dispatch_plan=static``) as
   the comparison: :func:`remoe.lab.bench.gpu.train_row` -- tokens/s, MFU against
   the data sheet and the measured matmul, peak memory, host syncs per step.

After every stage the whole result so far is written to ``gpu_check.json`` (atomically: a
temporary file, then a rename) in ``$OUT`` when set, else ``bench_results/``, and the log line
is appended to ``gpu_check.log`` beside it: a run cut off at any point has kept every finished
stage. A stage that fails records its error and the next one runs. Once ``--budget-s`` has
passed, the remaining rows are recorded as skipped. Without CUDA: one line, exit 0, no files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

#: (router, compile backend or None, static plan) in the order they run
ROWS = (("dense", None, False), ("topk", None, False), ("relu", None, False),
        ("dense", "inductor", False), ("topk", "inductor", False), ("relu", "inductor", False),
        ("relu", None, True))
NO_CUDA = ("gpu check: no CUDA device here (torch {torch}, torch.cuda.is_available() is False); "
           "nothing measured")


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for dist in ("triton", "transformers", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "capability": None, "memory_gib": None, "multiprocessors": None}
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}


class Recorder:
    """The cumulative result: every :meth:`save` rewrites ``gpu_check.json`` atomically."""

    def __init__(self, out_dir: Path, log=print) -> None:
        self.out_dir, self._log = Path(out_dir), log
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "gpu_check.json"
        self.res: dict = {"schema": "remoe-gpu-check/1", "command": " ".join(sys.argv),
                          "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}

    def log(self, line: str) -> None:
        self._log(line)
        with open(self.out_dir / "gpu_check.log", "a") as f:
            f.write(line + "\n")

    def save(self, stage: str, value) -> None:
        self.res["stages"][stage] = value
        tmp = self.path.with_name(".gpu_check.json.tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        os.replace(tmp, self.path)


def row_name(router: str, backend: str | None, static: bool) -> str:
    return router + (f"_compiled_{backend}" if backend else "_eager") + ("_static_plan" if static else "")


def run_check(device: torch.device, out_dir: Path, preset: str = "small", seq_len: int = 1024,
              micro_batch: int = 8, steps: int = 10, warmup: int = 3, budget_s: float = 420.0,
              rows=ROWS, check_preset: str = "micro", vocab: int | None = None,
              matmul_n: int = 8192, compile_backend: str | None = None, log=print) -> dict:
    """Every stage on ``device`` (CUDA in production; CPU in the tests, where
    ``compile_backend`` replaces inductor, whose CPU compilation takes minutes)."""
    from remoe.lab.bench import gpu

    t0 = time.perf_counter()
    rec = Recorder(out_dir, log)
    info = device_info(device)
    peak = gpu.peak_bf16_tflops(info["name"]) if device.type == "cuda" else None
    env = {"versions": versions(), "device": info, "peak_bf16_tflops": peak,
           "peak_source": "data sheet" if peak else None}
    env["matmul_bf16_tflops"] = gpu.matmul_tflops(device, n=matmul_n)
    rec.save("env", env)
    rec.log(f"[env] {info['name']} (sm {info['capability']}, {info['memory_gib']} GiB); "
            f"torch {env['versions']['torch']} cuda {env['versions']['cuda']} triton "
            f"{env['versions']['triton']} transformers {env['versions']['transformers']}; bf16 "
            f"peak {peak or 'unknown'}, matmul {env['matmul_bf16_tflops']:.1f} TFLOP/s")
    try:
        checks = gpu.loss_check(device, preset=check_preset)
        rec.save("bf16_check", checks)
        for c in checks:
            rec.log(f"[bf16_check] {c['router']}: loss rel diff {c['loss_rel_diff']:.1e}, grad "
                    f"cosine {c['grad_cosine']:.4f}: {'ok' if c['ok'] else 'MISMATCH'}")
    except Exception as e:  # recorded; the throughput rows still run
        rec.save("bf16_check", {"error": _error(e)})
        rec.log(f"[bf16_check] FAILED: {_error(e)[-300:]}")
    done = []
    for router, backend, static in rows:
        backend = compile_backend if (backend and compile_backend) else backend
        name = row_name(router, backend, static)
        if time.perf_counter() - t0 > budget_s:
            rec.save(name, {"skipped": f"over the {budget_s:.0f} s budget"})
            rec.log(f"[{name}] skipped (over the {budget_s:.0f} s budget)")
            continue
        try:
            from remoe.train.compile import compile_counters

            if backend:
                torch._dynamo.reset()
            before = compile_counters()
            row = gpu.train_row(router, device, preset, seq_len, micro_batch, steps, warmup,
                                vocab=vocab or gpu.GPT2_VOCAB, peak_tflops=peak,
                                matmul_peak=env["matmul_bf16_tflops"], compile_backend=backend,
                                static_plan=static)
            if backend:  # graphs compiled (recompilations included) and breaks in this row
                row["dynamo"] = {k: v - before[k] for k, v in compile_counters().items()}
                # a dispatch mode (the sync counter) makes dynamo run the eager code: with no
                # graph break the compiled graphs hold the same ops, so the same syncs
                row["syncs_counted_on"] = "eager code (no compiled code runs under the counter)"
        except Exception as e:
            rec.save(name, {"error": _error(e)})
            rec.log(f"[{name}] FAILED: {_error(e)[-300:]}")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rec.save(name, row)
        done.append(row)
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        rec.log(f"[{name}] {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (matmul "
                f"{row['mfu_vs_matmul']:.1%}), peak {row['peak_mem_gib'] or 0:.1f} GiB, syncs/step "
                f"{row['syncs_per_step']} ({row['syncs_forward']}/{row['syncs_backward']}/"
                f"{row['syncs_step']}), warm-up {row['warmup_s']:.0f} s")
    rec.res["elapsed_s"] = time.perf_counter() - t0
    rec.save("table", gpu.table({"rows": done, "fsdp_ep": None}))
    rec.log("\n" + rec.res["stages"]["table"])
    rec.log(f"wrote {rec.path} ({rec.res['elapsed_s']:.0f} s)")
    return rec.res


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip() + \
        "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where gpu_check.json / .log go (default: $OUT, else bench_results)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (default 3)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="no new row starts after this many seconds (default 420)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__))
        return 0
    out_dir = args.out_dir or Path(os.environ.get("OUT") or "bench_results")
    res = run_check(torch.device("cuda"), out_dir, micro_batch=args.micro_batch,
                    steps=args.steps, warmup=args.warmup, budget_s=args.budget_s)
    checks = res["stages"].get("bf16_check")
    return 1 if isinstance(checks, dict) or not all(c["ok"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
