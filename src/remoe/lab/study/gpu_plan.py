"""The GPU study's settings and plan (:mod:`remoe.lab.study.gpu_study`): the runs, each
device's defaults, how many steps every run trains and when it evaluates."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError


@dataclass(frozen=True)
class GPURun:
    name: str
    label: str
    sets: tuple[str, ...]


#: the runs, in order; the ReMoE runs' sparsity target is 1 - k/E = 0.875
RUNS = (
    GPURun("topk", "TopK (dMoE, LB loss 0.01)", ("model.router=topk",)),
    GPURun("remoe_rec", "ReMoE, recommended control (PI, ki 1, max_active 4)",
            ("model.router=relu", "model.lambda_update=pi", "model.lambda_pi_ki=1.0",
             "model.max_active=4")),
    GPURun("remoe_paper", "ReMoE, the paper's controller (sign, lambda0 1e-8, alpha 1.2)",
            ("model.router=relu", "model.lambda_update=sign", "model.lambda0=1e-8",
             "model.alpha=1.2")),
)
#: ReLU / TopK tokens per second assumed when sizing, before a ReMoE run has measured its own:
#: the H200's compiled rows at micro batch 8 and 16 gave 0.77 and 0.87 (docs/SCALING.md)
RELU_SPEED = 0.8


@dataclass
class Settings:
    """One study's settings, resolved for its device (:func:`resolve`)."""

    device: str
    precision: str
    compile: bool
    preset: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    lr: float
    min_lr: float
    warmup_steps: int
    probe_steps: int
    evals: int
    eval_chunks: int
    eval_batch: int
    whole_eval_chunks: int | None  # None: the whole validation split
    steps: int | None  # None: sized from the probe
    max_steps: int | None  # a cap on the sized steps (the CPU rehearsal's "few steps")
    budget_s: float
    deadline_s: float
    size_for: int
    relu_speed: float
    runs: tuple[str, ...]
    seed: int
    extra: tuple[str, ...]


# ----------------------------------------------------------------------------- the plan

def plan_steps(time_left_s: float, step_s: float, speeds: list[float], done: int,
               per_run_s: float, setup_s: float, min_steps: int, margin: float = 0.05) -> int:
    """Steps per run so that every run of ``speeds`` fits ``time_left_s`` (less ``margin``).

    Run i takes ``N * step_s / speeds[i]`` seconds of steps (``step_s``: the first run's
    measured seconds per step, ``speeds[0] == 1``), ``per_run_s`` of evaluations, and, after
    the first, ``setup_s`` to build and compile; the first run has ``done`` steps behind it.
    At least ``min_steps``."""
    if step_s <= 0 or not speeds:
        return min_steps
    avail = (time_left_s * (1.0 - margin) - per_run_s * len(speeds)
             - setup_s * (len(speeds) - 1) + done * step_s / speeds[0])
    n = math.floor(avail / (step_s * sum(1.0 / s for s in speeds)))
    return max(min_steps, n)


def eval_steps(n_steps: int, probe_steps: int, evals: int) -> list[int]:
    """The steps every run evaluates at: the end of the probe, ``evals`` evenly spaced steps,
    and the last step."""
    every = max(1, round(n_steps / max(1, evals)))
    steps = {s for s in range(every, n_steps + 1, every)} | {n_steps}
    if probe_steps < n_steps:
        steps.add(probe_steps)
    return sorted(steps)


def base_sets(s: Settings, data_dir: str, vocab: int, work_dir: Path) -> list[str]:
    """The experiment overrides every run shares (their order: base < run < ``--set``)."""
    threads = []
    if s.device == "cpu":  # torch here only: --build-data and --results-only run without it
        from torch import get_num_threads
        threads = [f"train.num_threads={get_num_threads()}"]
    # on CUDA ReLU's pairs go through the capacity plan: the exact plan's results without its
    # wait per layer (1.22x the exact plan's tokens/s on the H200, 2026-11-28; docs/GPU.md)
    plan = ["train.dispatch_plan=capacity"] if s.device == "cuda" else []
    return [f"model.preset={s.preset}", "model.num_experts=8", "model.top_k=1",
            f"data.cache_dir={data_dir}", f"data.vocab_size={vocab}",
            f"train.device={s.device}", f"train.precision={s.precision}",
            f"train.compile={str(s.compile).lower()}", f"train.seq_len={s.seq_len}",
            f"train.micro_batch_size={s.micro_batch}", f"train.grad_accum={s.grad_accum}",
            f"train.lr={s.lr}", f"train.min_lr={s.min_lr}",
            f"train.warmup_steps={s.warmup_steps}", "train.eval_every=0", "train.save_every=0",
            "train.log_every=0", f"train.eval_chunks_per_domain={s.eval_chunks}",
            f"train.eval_batch_size={s.eval_batch}", "analysis.record_masks_every=0",
            f"run.out_dir={work_dir}", f"run.seed={s.seed}"] + plan + threads


def step_seconds(records: list[dict[str, Any]], skip: int) -> float:
    """The trainer's seconds per step (``elapsed_s``: its steps alone, no evaluation) after
    the first ``skip`` steps (compilation)."""
    skip = max(0, min(skip, len(records) - 2))
    return ((records[-1]["elapsed_s"] - records[skip]["elapsed_s"]) / (len(records) - 1 - skip)
            if len(records) - 1 > skip else records[-1]["elapsed_s"] / len(records))


def tokens_per_step(s: Settings) -> int:
    """Tokens of one step (the sampler's chunks are ``seq_len + 1`` long: the shifted
    targets)."""
    return s.micro_batch * s.grad_accum * (s.seq_len + 1)


#: per-device defaults of the arguments left unset: (CUDA, CPU); the CPU path is a rehearsal
#: of the same code with a micro model and a few steps
DEFAULTS = {
    "preset": ("small", "micro"), "seq_len": (1024, 64), "micro_batch": (16, 2),
    "warmup_steps": (50, 3), "probe_steps": (24, 2), "evals": (16, 2), "eval_chunks": (16, 2),
    "eval_batch": (16, 4), "whole_eval_chunks": (None, 4), "steps": (None, None),
    "max_steps": (None, 6), "budget_s": (500.0, 20.0),
}


def resolve(args: argparse.Namespace, cuda: bool) -> Settings:
    v = {k: getattr(args, k) if getattr(args, k) is not None else d[0 if cuda else 1]
         for k, d in DEFAULTS.items()}
    if v["probe_steps"] >= v["warmup_steps"] and v["steps"] is None:
        raise ConfigError(f"--probe-steps={v['probe_steps']} must be < --warmup-steps="
                          f"{v['warmup_steps']}: the horizon is set inside the warm-up")
    names = tuple(args.runs.split(","))
    unknown = sorted(set(names) - {r.name for r in RUNS})
    if unknown:
        raise ConfigError(f"--runs: unknown run {unknown[0]!r} (known: "
                          f"{', '.join(r.name for r in RUNS)})")
    return Settings(
        device="cuda" if cuda else "cpu", precision="bf16" if cuda else "fp32",
        compile=bool(args.compile) and cuda, grad_accum=args.grad_accum, lr=args.lr,
        min_lr=args.min_lr, deadline_s=args.deadline_s or v["budget_s"] + 25.0,
        size_for=args.size_for or len(names), relu_speed=args.relu_speed, runs=names,
        seed=args.seed, extra=tuple(args.set), **v)

