"""``remoe bench``: layer / model / machine-ceiling benchmarks; prints tables, writes JSON.

    remoe bench --suite all --out bench_results/full.json
    remoe bench --suite layer --experts 8 32 128 --granularity 1 8 64
    remoe bench --quick                          # smoke version (< 1 minute)

JSON keys: ``schema``, ``command``, ``created``, ``quick``, ``machine`` (cpu model, cores,
torch / transformers versions, threads, allocator, load average), ``machine_ceiling``
(measured fp32 matmul GFLOP/s), ``layer`` (``rows``, ``targets``), ``model`` (``throughput``,
``stages``, ``memory``, ``targets``), ``elapsed_s``. Each target has ``value``, ``limit``,
``met`` and ``judged``: a ``--quick`` smoke run (``note`` says so) judges none (``met`` null).
Method: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from remoe.machine import allocator
from remoe.machine.allocator import MODES

SUITES = ("layer", "model", "machine", "all", "load", "scale", "gpu", "data")  # the last four: not in "all"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=SUITES, default="all", help="what to measure (default: all)")
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats: a smoke run")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: bench_results/<suite>[-quick].json)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement")
    p.add_argument("--rounds", type=int, default=None,
                   help="layer suite: rounds over a case's rows, each row in a fresh process per "
                        "round, order rotated (default 3; quick 1)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="start N CPU-bound processes for the whole run: measure 'beside a busy "
                        "process' on an otherwise idle machine (default 0)")
    p.add_argument("--allocator", choices=MODES, default="auto",
                   help="host allocator of the measuring processes (remoe.machine.allocator): auto "
                        "(default: tcmalloc when installed, else the system malloc), default, "
                        "tcmalloc, retain (glibc keeps freed large blocks)")
    g = p.add_argument_group("layer suite")
    g.add_argument("--tokens", type=int, default=4096, help="T (default 4096)")
    g.add_argument("--d-model", type=int, default=256)
    g.add_argument("--d-ffn", type=int, default=1024)
    g.add_argument("--top-k", type=int, default=1)
    g.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128],
                   help="E values swept at G=1 (default 8 32 128)")
    g.add_argument("--granularity", type=int, nargs="+", default=[1, 8, 64],
                   help="G values swept at E=8 (default 1 8 64)")
    g.add_argument("--grid", action="store_true", help="the full E x G grid instead of two sweeps")
    g.add_argument("--rows", nargs="+", default=None,
                   help="layer rows (default: dense relu topk relu_unfused hf_eager hf_grouped_mm; "
                        "also dense_wide relu_stage1: stage I vs a dense FFN E times as wide; "
                        "any registered router name also works)")
    g.add_argument("--router-module", nargs="+", default=[], metavar="MODULE",
                   help="modules that register routers (remoe.register_router) to import first")
    g.add_argument("--no-memory", action="store_true", help="skip the profiler memory pass")
    g = p.add_argument_group("load suite (needs the machine to itself)")
    g.add_argument("--load-steps", type=int, default=24,
                   help="steps of each default-config run (default 24)")
    g.add_argument("--load-config", type=Path, default=None,
                   help="experiment YAML (default: configs/tiny_remoe.yaml)")
    g = p.add_argument_group("model suite")
    g.add_argument("--preset", default=None, help="model preset (default tiny; quick: micro)")
    g.add_argument("--stage-steps", type=int, default=None,
                   help="max steps of the stages I-II run (default 150; quick 4)")
    g = p.add_argument_group("data suite (`remoe data` throughput and memory)")
    from remoe.lab.bench.data import add_data_arguments

    add_data_arguments(g)
    g = p.add_argument_group("gpu suite (CUDA; without it: one line, exit 0)")
    g.add_argument("--seq-len", type=int, default=1024, help="sequence length (default 1024)")
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per router (default 10)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak for MFU (default: the data-sheet table "
                        "in remoe.lab.bench.gpu; unknown devices report MFU vs a measured matmul)")


def _cases(args) -> list:
    from remoe.lab.bench.layer import LayerCase

    base = dict(T=args.tokens, d_model=args.d_model, d_ffn=args.d_ffn, k=args.top_k,
                seq_len=min(1024, args.tokens))
    if args.quick:
        base.update(T=512, d_model=64, d_ffn=256, seq_len=256)
        pairs = [(8, 1), (8, 4)]
    elif args.grid:
        pairs = [(E, G) for E in args.experts for G in args.granularity]
    else:
        pairs = [(E, 1) for E in args.experts] + [(args.experts[0], G) for G in args.granularity
                                                   if G != 1]
    return [LayerCase(E=E, G=G, **base) for E, G in pairs]


def _fmt_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = " | ".join(h for _, h, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for key, h, fmt in cols:
            v = r.get(key)
            cells.append(("-" if v is None else format(v, fmt)).rjust(len(h)))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


SMOKE_NOTE = ("smoke run (--quick): small shapes and few repeats check that every measurement "
              "runs; the targets are stated for the full shapes and are not judged")


def _judge(targets: list[dict], quick: bool) -> list[dict]:
    """A smoke run keeps the values but judges nothing: ``met`` is None, ``judged`` False."""
    for t in targets:
        t["judged"] = not quick
        if quick:
            t["met"] = None
    return targets


def _print_targets(targets: list[dict]) -> None:
    if targets and not any(t.get("judged", True) for t in targets):
        print("  targets not judged (smoke run: not the targets' shapes); values for reference:")
        for t in targets:
            print(f"  [ smoke] {t['target']}: {t['value']}")
        return
    for t in targets:
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        rng = f", rounds {t['range'][0]}..{t['range'][1]}" if t.get("range") else ""
        print(f"  [{mark:>6}] {t['target']}: {t['value']} (target {t['limit']}{rng})")


def _stages_line(st: dict) -> str:
    """One line on the stages I-II run; says so when it stopped before the sparsity settled."""
    if st["settled_at_step"] is None:
        return (f"stages: sparsity did not reach the target within the {st['steps_run']} steps run "
                f"(raise --stage-steps); relu ms/step in stages I-II "
                f"{st['relu_stage12_ms_per_step']:.1f}, no stage III step to compare")
    return (f"stages: settled at step {st['settled_at_step']} of {st['steps_run']}; relu ms/step "
            f"stage I-II {st['relu_stage12_ms_per_step']:.1f} vs stage III "
            f"{st['relu_stage3_ms_per_step']:.1f}; extra "
            f"{st.get('stage12_extra_s', float('nan')):.2f} s")


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `remoe bench --help` stays fast

    if args.suite == "gpu":
        return _run_gpu(args)
    if args.suite == "data":
        from remoe.lab.bench import data

        return data.run(args, args.out or Path("bench_results") / "data.json")
    from remoe.lab.bench.common import FreshProcesses

    from remoe.lab.bench import common

    allocator.check_mode(args.allocator, "remoe bench")
    if args.router_module:  # user routers: imported here and in every measuring child
        from remoe.model import registry

        registry.import_modules(args.router_module, "--router-module")
    alloc_desc = allocator.describe(args.allocator)

    if args.threads:
        torch.set_num_threads(args.threads)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(max(0, args.busy))]
    try:
        with FreshProcesses(args.allocator, args.router_module) as in_child:
            return _run(args, alloc_desc, common, in_child)
    finally:
        for sp in spinners:
            sp.kill()
            sp.wait()


def _run(args: argparse.Namespace, alloc_desc: str, common, in_child) -> int:
    import torch  # here, not at the top: `remoe bench --help` stays fast

    from remoe.machine import perf

    t_start = time.perf_counter()
    suite = args.suite
    out_path = args.out or Path("bench_results") / f"{suite}{'-quick' if args.quick else ''}.json"
    res = _header("remoe-bench/1", quick=bool(args.quick))
    res["machine"] = common.machine_info(alloc_desc)
    m = res["machine"]
    m["busy_spinners_started"] = args.busy
    if args.quick:
        res["note"] = SMOKE_NOTE
        print(SMOKE_NOTE)
    print(f"machine: {m['cpu_model']}, {m['cores_logical']} logical cores, torch {m['torch']}, "
          f"{m['threads']} threads, load {m['loadavg_start']}, allocator: {alloc_desc}")
    print("busy beside this run: " + (", ".join(f"{b['name']}[{b['pid']}] nice {b['nice']} "
                                                f"{b['cores']:.2f} cores"
                                                for b in m["busy_processes_start"]) or "nothing"))

    # On one thread, process CPU time is wall time minus the time other processes held the
    # core: the robust figure on a shared machine. With several threads, spinning workers
    # inflate CPU time, so wall time decides.
    metric = "cpu_ms" if torch.get_num_threads() == 1 else "wall_ms"
    res["metric"] = metric
    basis = "process CPU time (1 thread)" if metric == "cpu_ms" else "wall time"
    print("smoke run: no target is judged; ratios use " + basis if args.quick
          else f"targets are judged on {basis}")
    ceiling = perf.matmul_ceiling(quick=args.quick)
    res["machine_ceiling"] = ceiling
    print(f"machine ceiling: fp32 matmul {ceiling['matmul_fp32_gflops']:.1f} GFLOP/s "
          f"({ceiling['matmul_fp32_gflops_per_cpu_s']:.1f} per CPU second)")
    use_cpu = metric == "cpu_ms"
    peak = ceiling["matmul_fp32_gflops_per_cpu_s" if use_cpu else "matmul_fp32_gflops"]

    if suite in ("load", "scale"):  # the `remoe train` config they run
        from remoe.experiment import DEFAULT_CONFIG

        config = args.load_config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    if suite == "load":
        from remoe.lab.bench.scale import run_load

        print(f"\nload suite: `remoe train` ({config or 'default config'}), {args.load_steps} "
              "steps per run, alone and beside one CPU-bound process")
        res["load"] = run_load(config, steps=args.load_steps, allocator=args.allocator)
        print()
        print(_fmt_table(res["load"]["rows"], [
            ("condition", "condition               ", ""), ("setting", "threads             ", ""),
            ("tokens_per_s", "tokens/s", ",.0f"), ("vs_alone", "x alone", ".2f")]))

    if suite == "scale":  # remoe.lab.bench.scale: DDP / FSDP / FSDP+EP over 1, 2, 4 gloo processes
        from remoe.lab.bench.scale import run_scale

        quick = ["model.preset=micro", "train.seq_len=64"] if args.quick else []
        res["scale"] = run_scale(config, worlds=(1, 2) if args.quick else (1, 2, 4),
                                 steps=4 if args.quick else 8, extra=quick)
        print(f"\nscale suite: `remoe train` ({config or 'default config'}) under torchrun, gloo, "
              "1 thread per rank, the same micro batch per rank")
        print(_fmt_table(res["scale"]["rows"], [
            ("world", "ranks", ""), ("layout", "layout                  ", ""),
            ("tokens_per_s", "tokens/s", ",.0f"), ("tokens_per_s_per_rank", "per rank", ",.0f"),
            ("peak_rss_mb_max", "peak RSS MB (max rank)", ",.0f")]))

    if suite in ("layer", "all"):
        from remoe.lab.bench import layer

        reps = args.reps or (2 if args.quick else 5)
        rounds = args.rounds or (1 if args.quick else 3)
        rows_sel = tuple(args.rows) if args.rows else layer.ROWS
        rows = []
        where = ("rows of a case in one fresh process" if args.quick else
                 f"{rounds} rounds over the rows in rotated order, each row in a fresh process")
        print(f"\nlayer suite: forward+backward, median of {reps} calls after a warm-up, {where}")
        res["layer_method"] = {"reps": reps, "rounds": rounds, "fresh_process_per_row": not args.quick,
                               "order": "rotated by one row per round"}
        for case in _cases(args):
            kw = dict(rows=rows_sel, memory=not args.no_memory, use_cpu=use_cpu, rounds=rounds)
            if args.quick:  # smoke run: fewer process start-ups
                rows += in_child(layer.run_case, case, reps, peak, **kw)
            else:  # no allocator state carried from one row to the next
                rows += layer.run_case(case, reps, peak, runner=in_child,
                                       **kw)
        targets = _judge(layer.layer_targets(rows, metric), args.quick)
        res["layer"] = {"rows": rows, "targets": targets}
        print()
        print(_fmt_table(rows, [("case", "case          ", ""), ("row", "row           ", ""),
                                ("wall_ms", "fwd+bwd ms", ".1f"), ("vs_dense", "x dense", ".2f"),
                                ("cpu_ms", "cpu ms", ".1f"), ("cpu_rel_spread", "+-", ".2f"),
                                ("vs_dense_cpu", "x dense cpu", ".2f"),
                                ("peak_mem_mb", "peak MB", ".1f"),
                                ("gflops", "GFLOP/s", ".1f"), ("mfu", "MFU", ".2f"),
                                ("sparsity", "sparsity", ".3f")]))
        _print_targets(targets)

    if suite in ("model", "all"):
        from remoe.lab.bench import model

        reps = args.reps or (2 if args.quick else 8)
        preset = args.preset or ("micro" if args.quick else "tiny")
        kw = dict(preset=preset)
        if args.quick:
            kw.update(batch=2, seq=64)
        print(f"\nmodel suite ({preset}): training (fwd+bwd+AdamW) and inference, "
              f"median of {reps} interleaved rounds")
        thr = in_child(model.throughput, reps=reps, **kw)
        # host syncs of one real training step of each row on the CUDA code path (grouped_mm
        # backend, one micro-batch), counted on this machine (remoe.lab.bench.syncs)
        from remoe.lab.bench import syncs as step_syncs

        sync_rows = in_child(step_syncs.count_all, [r["row"] for r in thr], preset=preset,
                             grad_accum=1)
        for r, s in zip(thr, sync_rows):
            r.update(syncs_per_step=s["total"], syncs_forward=s["forward"],
                     syncs_backward=s["backward"], syncs_step=s["step"])
        for r in thr:
            if use_cpu:
                r["train_mfu"] = r["train_gflops"] * r["train_step_ms"] / r["train_cpu_ms"] / peak
                r["infer_mfu"] = r["infer_gflops"] * r["infer_ms"] / r["infer_cpu_ms"] / peak
            else:
                r["train_mfu"] = r["train_gflops"] / peak
                r["infer_mfu"] = r["infer_gflops"] / peak
        steps = args.stage_steps or (4 if args.quick else 150)
        # the stage run trains from init for up to `steps` steps: a smaller batch keeps it short
        st_kw = dict(kw) if args.quick else dict(kw, batch=4, seq=128)
        print(f"stages I-II: ReMoE from init vs TopK, up to {steps} steps, batch "
              f"{st_kw.get('batch', 8)}x{st_kw.get('seq', 256)}")
        st = in_child(model.stages, max_steps=steps,
                       extra_after_settle=2 if args.quick else 15, metric=metric, **st_kw)
        mem = in_child(model.memory, **kw)
        targets = _judge(model.model_targets(thr, mem, metric, preset=preset), args.quick)
        res["model"] = {"preset": preset, "throughput": thr, "stages": st, "memory": mem,
                        "targets": targets, "syncs": sync_rows}
        print()
        print(_fmt_table(thr, [("row", "row   ", ""), ("train_tokens_per_s", "train tok/s", ".0f"),
                               ("train_vs_dense", "x dense", ".2f"),
                               ("train_vs_dense_cpu", "x dense cpu", ".2f"), ("train_mfu", "MFU", ".2f"),
                               ("infer_tokens_per_s", "infer tok/s", ".0f"),
                               ("infer_vs_dense", "x dense", ".2f"),
                               ("infer_vs_dense_cpu", "x dense cpu", ".2f"),
                               ("sparsity_mean", "sparsity", ".3f"),
                               ("syncs_per_step", "syncs/step", "d"),
                               ("active_params", "active params", "d")]))
        print("syncs/step: host synchronisations of one training step on the CUDA code path "
              "(grouped_mm, 1 micro-batch), counted here: " + ", ".join(
                  f"{s['router']} {s['forward']} fwd + {s['backward']} bwd + {s['step']} step"
                  for s in sync_rows))
        print(_stages_line(st))
        for mm in mem:
            print(f"memory (recompute_experts={mm['recompute_experts']}): dense stage "
                  f"{mm['dense_peak_mb']:.1f} MB, sparse {mm['sparse_peak_mb']:.1f} MB, "
                  f"ratio {mm['dense_vs_sparse']:.2f}")
        _print_targets(targets)

    res["machine"]["loadavg_end"] = common.loadavg()
    res["machine"]["busy_processes_end"] = common.busy_processes()
    _write(out_path, res, t_start, " [smoke run]" if args.quick else "")
    return 0


def _header(schema: str, **extra) -> dict:
    """The first keys of a result: ``schema``, ``command``, ``created``, then ``extra``."""
    return {"schema": schema, "command": " ".join(sys.argv),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}


def _write(out_path: Path, res: dict, t_start: float, note: str = "") -> None:
    """``res`` with ``elapsed_s`` (since ``t_start``) as JSON in ``out_path``; says so."""
    res["elapsed_s"] = time.perf_counter() - t_start
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1, default=float))
    print(f"\nwrote {out_path} ({res['elapsed_s']:.0f} s)" + note)


def _run_gpu(args: argparse.Namespace) -> int:
    """``--suite gpu`` (remoe.lab.bench.gpu_check.run_suite): one line and exit 0 without CUDA."""
    import torch

    from remoe.lab.bench import gpu_check

    if not torch.cuda.is_available():
        print(gpu_check.NO_CUDA.format(what="gpu suite", torch=torch.__version__))
        return 0
    t_start = time.perf_counter()
    out_path = args.out or Path("bench_results") / "gpu.json"
    res = _header("remoe-bench-gpu/1", torch=torch.__version__, cuda=torch.version.cuda,
                  gpus=torch.cuda.device_count())
    res.update(gpu_check.run_suite(torch.device("cuda"), preset=args.preset or "small",
                                   seq_len=args.seq_len, micro_batch=args.micro_batch,
                                   steps=args.steps, peak_tflops=args.peak_tflops))
    _write(out_path, res, t_start)
    bad = [r["router"] for r in res["loss_check"] if not r["ok"]]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remoe bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
