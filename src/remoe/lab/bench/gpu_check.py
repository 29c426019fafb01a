"""``scripts/gpu_check.sh``: the whole GPU measurement in one command, stage by stage.

Runs from a source checkout with the machine's own ``python3`` (``PYTHONPATH=src``, nothing
installed; no zstandard, no lm-eval, no internet: synthetic token batches). Stages, in order
of what matters if the run is cut off:

1. ``env``: Python / torch / CUDA / triton / transformers versions, the device, its
   data-sheet bf16 peak (:data:`remoe.lab.bench.gpu.PEAK_BF16_TFLOPS`) and a measured bf16 matmul;
2. ``bf16_check``: bf16 autocast vs fp32 loss and gradient (:func:`remoe.lab.bench.gpu.loss_check`);
3. ``head_loss``: the LM head + cross-entropy alone at the step's micro-batch shape, whole,
   chunked (``train.loss_chunk_tokens``) and compiled (``train.compile_loss``): time and peak
   memory;
4. one stage per row of :data:`ROWS`, the realistic step first: dense / TopK / ReLU at the
   ``small`` preset (E=8, k=1, sequence 1024), each decoder block compiled (inductor), 64
   sequences per optimizer step (the paper's per-GPU share of its 512 x 1024 batch on 8 GPUs:
   micro batch 16 x 4, then 32 x 2), ReLU on the capacity plan (no sync, no graph break) and
   on the exact plan (``nonzero``) with and without dynamo capturing it, then fused AdamW,
   the chunked loss and the compiled loss: :func:`remoe.lab.bench.gpu.train_row` -- tokens/s,
   (token, expert) pairs per token (ReLU calibrated on the very batches timed: TopK's count),
   MFU against the data sheet and the measured matmul, peak memory, host syncs per step, and
   for the first rows a profile of one step by kernel category. The table compares every ReLU
   row with its TopK row per token and per active pair.

After every stage the whole result so far is written to ``gpu_check.json`` (atomically: a
temporary file, then a rename) in ``$OUT`` when set, else ``bench_results/``, and the log line
is appended to ``gpu_check.log`` beside it: a run cut off at any point has kept every finished
stage. A stage that fails records its error and the next one runs. Once ``--budget-s`` has
passed, the remaining rows are recorded as skipped. Without CUDA: one line, exit 0, no files.

Here too: the driver of ``remoe bench --suite gpu`` (:func:`run_suite`, the parts in
:mod:`remoe.lab.bench.gpu`), and the rows of both as text: a row's stage name and label, the
markdown table docs/SCALING.md publishes, each ReLU row against its TopK row.
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

from remoe.fileio import atomic_write_text
from remoe.lab.bench import gpu


def _row(router: str, mb: int = 16, accum: int = 4, plan: str = "capacity", compiled: bool = True,
         capture: bool = False, adamw: str = "auto", chunk: int = 0, profile: bool = False,
         step: tuple[str, ...] = ()):
    return {"router": router, "micro_batch": mb, "grad_accum": accum, "plan": plan,
            "backend": "inductor" if compiled else None, "capture_dynamic": capture,
            "adamw": adamw, "loss_chunk": chunk, "profile": profile, "step_options": list(step)}


#: the rows in the order they run (what matters most first, if the budget cuts the rest)
ROWS = (
    _row("topk", profile=True), _row("relu", profile=True), _row("dense", profile=True),
    _row("relu", plan="exact"), _row("relu", plan="exact", capture=True),
    _row("topk", adamw="fused"), _row("relu", adamw="fused"),
    _row("topk", adamw="fused", chunk=4096), _row("relu", adamw="fused", chunk=4096),
    _row("dense", adamw="fused", chunk=4096),
    _row("topk", 32, 2, adamw="fused"), _row("relu", 32, 2, adamw="fused"),
    _row("dense", 32, 2, adamw="fused"),
    _row("topk", 32, 2, adamw="fused", step=("compile_loss",)),
    _row("relu", 32, 2, adamw="fused", step=("compile_loss",)),
    _row("relu", adamw="fused", step=("prefetch", "cast_experts_once")),
    _row("topk", adamw="fused", step=("prefetch", "cast_experts_once")),
)
NO_CUDA = ("{what}: no CUDA device here (torch {torch}, torch.cuda.is_available() is False); "
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
        atomic_write_text(self.path, json.dumps(self.res, indent=1, default=str))


def run_check(device: torch.device, out_dir: Path, preset: str = "small", seq_len: int = 1024,
              steps: int = 6, warmup: int = 3, budget_s: float = 400.0, rows=ROWS,
              check_preset: str = "micro", vocab: int | None = None, matmul_n: int = 8192,
              compile_backend: str | None = None, log=print) -> dict:
    """Every stage on ``device`` (CUDA in production; CPU in the tests, where
    ``compile_backend`` replaces inductor, whose CPU compilation takes minutes)."""
    from remoe.model.config import ReMoEConfig

    t0 = time.perf_counter()
    rec = Recorder(out_dir, log)
    info = gpu.device_info(device)
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
    try:  # the LM head + loss alone, at the first row's micro-batch (whole, then chunked)
        hidden = ReMoEConfig.from_preset(preset).hidden_size
        tokens = rows[0]["micro_batch"] * seq_len if rows else seq_len
        v = vocab or gpu.GPT2_VOCAB
        head = [gpu.head_loss(device, hidden, v, tokens, chunk=c) for c in (0, 4096)]
        head.append(gpu.head_loss(device, hidden, v, tokens, compiled=True))
        rec.save("head_loss", head)
        rec.log("[head_loss] " + "; ".join(
            f"{'chunk ' + str(h['chunk']) if h['chunk'] else 'whole'}"
            f"{' compiled' if h.get('compiled') else ''}: {h['ms']:.1f} ms, peak +"
            f"{h['peak_extra_gib'] or 0:.2f} GiB" for h in head))
    except Exception as e:
        rec.save("head_loss", {"error": _error(e)})
        rec.log(f"[head_loss] FAILED: {_error(e)[-300:]}")
    done = []
    for row in rows:
        row = dict(row)
        if row["backend"] and compile_backend:
            row["backend"] = compile_backend
        name = row_name(row)
        if time.perf_counter() - t0 > budget_s:
            rec.save(name, {"skipped": f"over the {budget_s:.0f} s budget"})
            rec.log(f"[{name}] skipped (over the {budget_s:.0f} s budget)")
            continue
        try:
            from remoe.train.runtime import compile_counters, graph_break_reasons

            if row["backend"]:
                torch._dynamo.reset()
            before, reasons_before = compile_counters(), graph_break_reasons()
            res = gpu.train_row(row["router"], device, preset, seq_len, row["micro_batch"], steps,
                                warmup, vocab=vocab or gpu.GPT2_VOCAB, peak_tflops=peak,
                                matmul_peak=env["matmul_bf16_tflops"],
                                compile_backend=row["backend"], plan=row["plan"],
                                grad_accum=row["grad_accum"],
                                capture_dynamic=row["capture_dynamic"], adamw=row["adamw"],
                                loss_chunk=row["loss_chunk"], profile=row["profile"],
                                step_options=tuple(row["step_options"]))
            if row["backend"]:  # graphs compiled (recompilations included) and breaks in this row
                res["dynamo"] = {k: v - before[k] for k, v in compile_counters().items()}
                # why each break happened (dynamo's message, cut to 400 characters): the fix
                # is chosen from the device's own torch, which may differ from the CPU's
                res["dynamo"]["graph_break_reasons"] = {
                    k[:400]: n - reasons_before.get(k, 0)
                    for k, n in graph_break_reasons().items() if n > reasons_before.get(k, 0)}
                # a dispatch mode (the sync counter) makes dynamo run the eager code: with no
                # graph break the compiled graphs hold the same ops, so the same syncs
                res["syncs_counted_on"] = "eager code (no compiled code runs under the counter)"
        except Exception as e:
            rec.save(name, {"error": _error(e)})
            rec.log(f"[{name}] FAILED: {_error(e)[-300:]}")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rec.save(name, res)
        done.append(res)
        mfu = f"{res['mfu']:.1%}" if res["mfu"] is not None else "-"
        ppt = f"{res['pairs_per_token']:.3f}" if res["pairs_per_token"] is not None else "-"
        rec.log(f"[{name}] {res['tokens_per_s']:,.0f} tokens/s, pairs/token {ppt}, MFU {mfu} "
                f"(matmul {res['mfu_vs_matmul']:.1%}), peak {res['peak_mem_gib'] or 0:.1f} GiB, "
                f"syncs/step {res['syncs_per_step']} ({res['syncs_forward']}/"
                f"{res['syncs_backward']}/{res['syncs_step']}), warm-up {res['warmup_s']:.0f} s"
                + (f", graphs {res['dynamo']['frames']} breaks {res['dynamo']['graph_breaks']}"
                   if "dynamo" in res else ""))
        for why, n in (res.get("dynamo") or {}).get("graph_break_reasons", {}).items():
            rec.log(f"[{name}] graph break x{n}: {why[:200]}")
        if res.get("profile"):
            p = res["profile"]
            cats = ", ".join(f"{k} {v:.1f}" for k, v in p["by_category_ms"].items())
            rec.log(f"[{name}] profile of one step: wall {p['wall_ms']:.1f} ms, busy "
                    f"{p['busy_ms']:.1f}, idle {p['idle_ms']:.1f}; {cats}; the host launched "
                    f"{p['host_ops']} operators outside {p['compiled_calls']} compiled calls")
    rec.res["elapsed_s"] = time.perf_counter() - t0
    rec.res["relu_vs_topk"] = relu_vs_topk(done)
    rec.save("table", table({"rows": done, "fsdp_ep": None}))
    rec.log("\n" + rec.res["stages"]["table"])
    rec.log(f"wrote {rec.path} ({rec.res['elapsed_s']:.0f} s)")
    return rec.res


def run_suite(device: torch.device, preset: str = "small", seq_len: int = 1024,
              micro_batch: int = 8, steps: int = 10, warmup: int = 3,
              peak_tflops: float | None = None, routers=gpu.ROUTERS, check_preset: str = "micro",
              vocab: int = gpu.GPT2_VOCAB, matmul_n: int = 8192, log=print) -> dict:
    """Every part of the suite on ``device`` (CUDA in production; CPU in the tests)."""
    name = gpu.device_info(device)["name"]
    peak = peak_tflops or (gpu.peak_bf16_tflops(name) if device.type == "cuda" else None)
    res = {"device": name, "peak_bf16_tflops": peak,
           "peak_source": ("--peak-tflops" if peak_tflops else "data sheet" if peak else None)}
    res["matmul_bf16_tflops"] = gpu.matmul_tflops(device, n=matmul_n)
    log(f"device: {name}; bf16 peak {peak or 'unknown'} TFLOP/s ({res['peak_source']}); "
        f"measured bf16 matmul {res['matmul_bf16_tflops']:.1f} TFLOP/s")
    res["loss_check"] = gpu.loss_check(device, routers, preset=check_preset)
    for r in res["loss_check"]:
        log(f"  bf16 vs fp32 ({r['preset']} {r['router']}): loss {r['loss_bf16']:.4f} vs "
            f"{r['loss_fp32']:.4f} (rel {r['loss_rel_diff']:.1e}), grad cosine "
            f"{r['grad_cosine']:.4f}: {'ok' if r['ok'] else 'MISMATCH'}")
    res["rows"] = []
    for router in routers:
        row = gpu.train_row(router, device, preset, seq_len, micro_batch, steps, warmup,
                        vocab=vocab, peak_tflops=peak, matmul_peak=res["matmul_bf16_tflops"])
        res["rows"].append(row)
    res["fsdp_ep"] = None
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        try:
            res["fsdp_ep"] = gpu.fsdp_ep_row()
        except Exception as e:  # reported, not raised: the other figures stand
            res["fsdp_ep"] = {"layout": "fsdp+ep", "world": 2, "error": str(e)[-500:]}
    log("")
    log(table(res))
    return res


def row_name(row: dict) -> str:
    """A gpu-check row's stage name: ``relu_compiled_inductor_capacity_mb16x4_fused_chunk4096``
    (``row``: router, backend, plan, capture_dynamic, micro_batch, grad_accum, adamw,
    loss_chunk)."""
    name = row["router"] + (f"_compiled_{row['backend']}" if row["backend"] else "_eager")
    if row["router"] != "dense":
        name += f"_{row['plan']}" + ("_captured" if row["capture_dynamic"] else "")
    name += f"_mb{row['micro_batch']}x{row['grad_accum']}"
    if row["adamw"] != "auto":
        name += f"_{row['adamw']}"
    if row["loss_chunk"]:
        name += f"_chunk{row['loss_chunk']}"
    for option in row.get("step_options", ()):
        name += f"_{option}"
    return name


def _row_label(r: dict) -> str:
    name = r["router"] + (", compiled" if r.get("compiled") else "")
    if r["router"] != "dense" and r.get("plan", "exact") != "exact":
        name += f", {r['plan']} plan"
    if r.get("capture_dynamic"):
        name += ", nonzero captured"
    if r.get("adamw", "auto") != "auto":
        name += f", {r['adamw']} AdamW"
    if r.get("loss_chunk"):
        name += f", loss chunk {r['loss_chunk']}"
    for option in r.get("step_options", ()):
        name += f", {option.replace('_', ' ')}"
    return name


def table(res: dict) -> str:
    """The markdown table docs/SCALING.md publishes, then ReLU against TopK at the same micro
    batch, accumulation and compile setting: tokens/s and per active (token, expert) pair."""
    head = ("| device | preset | row | mb x accum | tokens/s | pairs/token | MFU (data sheet) | "
            "MFU (matmul) | peak GiB | syncs/step (fwd/bwd/step) |")
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in res["rows"]:
        lines.append(f"| {r['device']} | {r['preset']} | {_row_label(r)} | "
                     f"{r['micro_batch']} x {r.get('grad_accum', 1)} | {r['tokens_per_s']:,.0f} | "
                     f"{f(r.get('pairs_per_token'), '.3f')} | {f(r['mfu'], '.1%')} | "
                     f"{f(r['mfu_vs_matmul'], '.1%')} | {f(r['peak_mem_gib'], '.1f')} | "
                     f"{r['syncs_per_step']} ({r['syncs_forward']}/{r['syncs_backward']}/"
                     f"{r['syncs_step']}) |")
    ratios = relu_vs_topk(res["rows"])
    if ratios:
        lines += ["", "| ReLU row | vs TopK row | tokens/s ratio | per active pair | pairs/token "
                  "ReLU / TopK |", "|---|---|---:|---:|---:|"]
        for q in ratios:
            lines.append(f"| {q['relu']} | {q['topk']} | {q['tokens_ratio']:.3f} | "
                         f"{q['pair_ratio']:.3f} | {q['pairs_relu']:.3f} / {q['pairs_topk']:.3f} |")
    fe = res.get("fsdp_ep")
    if fe is None:
        lines.append("\nFSDP+EP, 2 processes: not run (fewer than 2 GPUs)")
    elif "error" in fe:
        lines.append(f"\nFSDP+EP, 2 processes: FAILED: {fe['error']}")
    else:
        lines.append(f"\nFSDP+EP, 2 processes (micro model, NCCL): {fe['tokens_per_s']:,.0f} "
                     f"tokens/s")
    return "\n".join(lines)


def relu_vs_topk(rows: list[dict]) -> list[dict]:
    """Each ReLU row against the TopK row of the same micro batch, accumulation, compile
    setting, AdamW, loss chunk and step options (the defaults when no TopK row has the same
    options): the tokens/s ratio and the ratio of (token, expert) pairs per second, which holds
    the comparison at equal work when the pairs per token differ."""
    def key(r, full=True):
        base = (r["micro_batch"], r.get("grad_accum", 1), r.get("compiled"))
        return base + ((r.get("adamw", "auto"), r.get("loss_chunk", 0),
                        tuple(r.get("step_options", ()))) if full else ())

    topk = {key(r): r for r in rows if r["router"] == "topk"}
    plain = {key(r, False): r for r in rows if r["router"] == "topk"
             and r.get("adamw", "auto") == "auto" and not r.get("loss_chunk")
             and not r.get("step_options")}
    out = []
    for r in rows:
        if r["router"] != "relu":
            continue
        t = topk.get(key(r)) or plain.get(key(r, False))
        if t is None or not r.get("pairs_per_token") or not t.get("pairs_per_token"):
            continue
        tok = r["tokens_per_s"] / t["tokens_per_s"]
        out.append({"relu": _row_label(r), "topk": _row_label(t), "tokens_ratio": tok,
                    "pair_ratio": tok * r["pairs_per_token"] / t["pairs_per_token"],
                    "pairs_relu": r["pairs_per_token"], "pairs_topk": t["pairs_per_token"],
                    "micro_batch": r["micro_batch"], "grad_accum": r.get("grad_accum", 1)})
    return out


def _error(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip() + \
        "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where gpu_check.json / .log go (default: $OUT, else bench_results)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (default 6)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (default 3)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="no new row starts after this many seconds (default 400)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA.format(what="gpu check", torch=torch.__version__))
        return 0
    out_dir = args.out_dir or Path(os.environ.get("OUT") or "bench_results")
    res = run_check(torch.device("cuda"), out_dir, steps=args.steps, warmup=args.warmup,
                    budget_s=args.budget_s)
    checks = res["stages"].get("bf16_check")
    return 1 if isinstance(checks, dict) or not all(c["ok"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
