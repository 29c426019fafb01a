"""The GPU study's plan and runs (:mod:`remoe.lab.study.gpu_study`): the runs, each device's
defaults, how many steps every run trains and when it evaluates; then the runs themselves, one
after the other, each trained with the trainer's own step, evaluated at the plan's steps,
written after every evaluation."""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError
from remoe.lab.study import gpu_report


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


# ----------------------------------------------------------------------------- the runs

class Study:
    """The runs of one study, their plan and what is written after every evaluation."""

    def __init__(self, s: Settings, bundle, out: gpu_report.Output, work_dir: Path,
                 data_info: dict[str, Any], env: dict[str, Any], t0: float) -> None:
        self.s, self.bundle, self.out, self.work_dir, self.t0 = s, bundle, out, work_dir, t0
        self.n_steps: int | None = s.steps
        self.plan: dict[str, Any] = {"steps": s.steps, "sized": s.steps is None,
                                     "tokens_per_step": tokens_per_step(s),
                                     "eval_steps": (eval_steps(s.steps, s.probe_steps, s.evals)
                                                    if s.steps else None)}
        self.rows: dict[str, dict[str, Any]] = {}
        self.summary = {"schema": "remoe-gpu-study/1", "command": " ".join(sys.argv),
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "state": "running",
                        **env, "settings": asdict(s), "data": data_info,
                        "plan": self.plan, "runs": self.rows}
        self.rates: dict[str, float] = {}  # seconds per step measured by each finished run

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.summary["elapsed_s"] = self.now()
        self.out.write_summary(self.summary)

    # -- the sequence ----------------------------------------------------------------------
    def run_all(self) -> dict[str, Any]:
        specs = [r for r in RUNS if r.name in self.s.runs]
        for i, spec in enumerate(specs):
            why = self._skip_reason(i)
            if why:
                self.rows[spec.name] = {"label": spec.label, "state": "skipped", "reason": why}
                self.out.log(f"[{spec.name}] skipped: {why}")
                self.save()
                continue
            self._run(spec, first=i == 0, sized_runs=specs[:max(1, self.s.size_for)])
            self.save()
            gpu_report.write(self.out.dir)
        self.summary["state"] = "done"
        self.save()
        gpu_report.write(self.out.dir)
        return self.summary

    def _skip_reason(self, i: int) -> str | None:
        if self.now() > self.s.deadline_s:
            return f"past the {self.s.deadline_s:.0f} s deadline"
        if i == 0:
            return None
        if self.n_steps is None:  # the first run could not size the study
            return "no step budget (the first run did not finish its probe)"
        if i < self.s.size_for or self.s.steps is not None:
            return None
        step_s = (self.rates.get("adaptive") or self.plan.get("step_s", 0.0) / self.s.relu_speed)
        need = (self.plan.get("setup_s", 0.0) + self.n_steps * step_s
                + self.plan.get("per_run_eval_s", 0.0))
        if self.now() + need > self.s.budget_s:
            return (f"would end at ~{self.now() + need:.0f} s, past the {self.s.budget_s:.0f} s "
                    "budget")
        return None

    def _run(self, spec: GPURun, first: bool, sized_runs: list[GPURun]) -> None:
        import torch

        from remoe.experiment import load_config
        from remoe.train.trainer import Trainer

        sets = base_sets(self.s, str(self.bundle.cache_dir), self.bundle.vocab_size,
                         self.work_dir) + list(spec.sets) \
            + [f"run.name={spec.name}", f"train.max_steps={self.n_steps or 10**9}"] \
            + list(self.s.extra)
        row = self.rows[spec.name] = {"label": spec.label, "state": "starting",
                                      "sets": list(spec.sets)}
        rec: dict[str, Any] = {"schema": "remoe-gpu-study-run/1", "name": spec.name,
                               "label": spec.label, "sets": sets, "state": "starting"}
        t_start = self.now()
        trainer = None
        try:
            cfg = load_config(None, sets)
            trainer = Trainer(cfg, progress=False, data=self.bundle)
            self._train(spec, trainer, rec, row, t_start, first, sized_runs)
        except Exception as e:  # recorded; the next run goes on
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            rec.update(state="failed", error=err,
                       traceback="".join(traceback.format_tb(e.__traceback__)[-4:]))
            row.update(state="failed", error=err)
            self.out.log(f"[{spec.name}] FAILED: {err[-400:]}")
            self.out.write_run(spec.name, rec)
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            if self.s.compile:  # the compiled graphs of this run's model go with it
                torch._dynamo.reset()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _autocast(self, t):
        import torch

        if t.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=t.device.type, dtype=t.autocast_dtype)

    def _train(self, spec: GPURun, t, rec: dict[str, Any], row: dict[str, Any],
               t_start: float, first: bool, sized_runs: list[GPURun]) -> None:
        from remoe.experiment import padded_vocab

        s = self.s
        model_cfg = t.model_cfg
        vocab = model_cfg.backbone.vocab_size
        if vocab != padded_vocab(self.bundle.vocab_size):
            raise ConfigError(f"the model's vocabulary ({vocab}) is not the "
                              f"tokenizer's ({self.bundle.vocab_size}) padded")
        rec["model"] = {"preset": s.preset, "router": model_cfg.routing.router,
                        "vocab_size": vocab,
                        "tokenizer_vocab": self.bundle.vocab_size,
                        "params_total": t.model.num_parameters(),
                        "params_active": t.model.num_parameters(active=True),
                        "target_sparsity": model_cfg.routing.target_sparsity,
                        "adaptive": bool(model_cfg.uses_adaptive_reg)}
        records: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        intervals: list[dict[str, Any]] = []
        ends: list[float] = []  # study time at the end of each step
        eval_s: list[float] = []
        at = set(eval_steps(self.n_steps, s.probe_steps, s.evals)) if self.n_steps else set()
        setup_s = self.now() - t_start
        m = rec["model"]
        self.out.log(f"[{spec.name}] built in {setup_s:.1f} s: {m['params_total'] / 1e6:.1f}M "
                     f"parameters ({m['params_active'] / 1e6:.1f}M active), vocabulary "
                     f"{vocab} (BPE {self.bundle.vocab_size})")
        rec["state"] = row["state"] = "running"
        rec["whole_validation"] = None
        last_eval_step = 0
        while self.n_steps is None or t.step < self.n_steps:
            if self.now() > s.deadline_s:
                rec["state"] = row["state"] = "cut"
                rec["cut"] = f"at step {t.step}: past the {s.deadline_s:.0f} s deadline"
                self.out.log(f"[{spec.name}] cut {rec['cut']}")
                break
            r = t.train_step()
            t.metrics.write(r)
            records.append(r)
            ends.append(self.now())
            sized_now = first and self.n_steps is None and t.step == s.probe_steps
            if t.step in at or sized_now:
                e0 = time.perf_counter()
                with self._autocast(t):
                    if sized_now:  # an unrecorded first pass compiles the evaluation graphs
                        self._validation(t, s.eval_chunks)
                    e1 = time.perf_counter()
                    ev = t.evaluate()
                eval_s.append(time.perf_counter() - e0)
                steady_s = time.perf_counter() - e1
                ev = dict(ev, flops=t.total_flops, eval_s=eval_s[-1])
                evals.append(ev)
                stats = gpu_report.layer_stats([x for x in records if x["step"] > last_eval_step])
                if stats is not None:
                    intervals.append(stats)
                last_eval_step = t.step
                if sized_now:
                    self._size(spec, ends, eval_s[-1] - steady_s, steady_s, t_start, sized_runs)
                    at = set(eval_steps(self.n_steps, s.probe_steps, s.evals))
                    t.cfg.train.max_steps = self.n_steps  # the schedule's horizon (gpu_study doc)
                self._write(spec, t, rec, row, records, evals, intervals, ends, eval_s, setup_s)
                self.out.log(f"[{spec.name}] step {t.step}/{self.n_steps}: val {ev['val_loss']:.4f}"
                             f", train {r['lm_loss']:.4f}, sparsity {r['sparsity']:.3f}, "
                             f"{t.tokens:,} tokens, {self.now():.0f} s")
        if rec["state"] == "running":
            rec["whole_validation"] = self._whole_eval(t)
            rec["state"] = row["state"] = "done"
            if model_cfg.uses_adaptive_reg and len(records) > s.probe_steps + 1:
                self.rates["adaptive"] = step_seconds(records, s.probe_steps)
        self._write(spec, t, rec, row, records, evals, intervals, ends, eval_s, setup_s,
                    final=True)
        t.metrics.close()
        t.evals.close()
        whole = rec.get("whole_validation") or {}
        self.out.log(f"[{spec.name}] {rec['state']}: {t.step} steps, {t.tokens:,} tokens, "
                     f"whole validation {whole.get('loss', float('nan')):.4f}, "
                     f"{self.now():.0f} s")

    def _size(self, spec: GPURun, ends: list[float], first_eval_s: float, eval_s: float,
              t_start: float, sized_runs: list[GPURun]) -> None:
        """The study's steps per run, from the first run's probe (gpu_study's docstring): wall
        seconds per step after the first third of the probe (compilation), the run's set-up
        (build, compilation) beyond that, and the evaluations: the first of a run compiles."""
        s = self.s
        skip = len(ends) // 3
        step_s = ((ends[-1] - ends[skip]) / (len(ends) - 1 - skip) if len(ends) - 1 > skip
                  else ends[-1] - t_start)
        setup_s = max(0.0, ends[-1] - t_start - len(ends) * step_s)
        chunks = len(self.bundle.split("validation").chunks(s.seq_len))
        sample = min(chunks, s.eval_chunks * len(self.bundle.domains))
        whole = min(chunks, (s.whole_eval_chunks or chunks) * len(self.bundle.domains))
        # compiling twice per run (training batches, then the last, smaller, evaluation batch)
        per_run_s = 2 * first_eval_s + eval_s * (s.evals + 1 + whole / max(1, sample))
        speeds = [1.0] + [s.relu_speed] * (len(sized_runs) - 1)
        n = plan_steps(s.budget_s - self.now(), step_s, speeds, len(ends), per_run_s, setup_s,
                       min_steps=s.probe_steps + 1)
        if s.max_steps is not None:
            n = max(s.probe_steps + 1, min(n, s.max_steps))
        self.n_steps = n
        tokens_step = tokens_per_step(s)
        self.plan.update(steps=n, step_s=step_s, setup_s=setup_s, first_eval_s=first_eval_s,
                         eval_s=eval_s,
                         per_run_eval_s=per_run_s, sized_for=[r.name for r in sized_runs],
                         speeds=speeds, tokens_per_step=tokens_step, tokens_per_run=n * tokens_step,
                         eval_steps=eval_steps(n, s.probe_steps, s.evals),
                         sized_at_s=self.now())
        self.out.log(f"[plan] {spec.name}: {step_s * 1e3:.0f} ms/step "
                     f"({tokens_step / step_s:,.0f} tokens/s), setup {setup_s:.0f} s, eval "
                     f"{eval_s:.1f} s -> {n} steps ({n * tokens_step / 1e6:.1f}M tokens) per run "
                     f"for {', '.join(r.name for r in sized_runs)}")

    def _validation(self, t, chunks: int | None) -> dict[str, Any]:
        """The loss on ``chunks`` validation sequences per domain (None: all), not recorded."""
        from remoe.model.losses import evaluate_loss

        return evaluate_loss(t.model, self.bundle.eval_batches(
            "validation", seq_len=self.s.seq_len, batch_size=self.s.eval_batch,
            max_chunks_per_domain=chunks), list(self.bundle.domains), device=t.device)

    def _whole_eval(self, t) -> dict[str, Any] | None:
        if self.now() > self.s.deadline_s:
            return None
        s = self.s
        t0 = time.perf_counter()
        with self._autocast(t):
            res = self._validation(t, s.whole_eval_chunks)
        return {"loss": res["loss"], "ppl": res["ppl"], "tokens": res["tokens"],
                "domains": {d: v["loss"] for d, v in res["domains"].items()},
                "chunks_per_domain": s.whole_eval_chunks or "all",
                "eval_s": time.perf_counter() - t0}

    def _write(self, spec, t, rec, row, records, evals, intervals, ends, eval_s, setup_s,
               final: bool = False) -> None:
        from remoe.train.metrics import run_summary

        s = self.s
        end = gpu_report.layer_stats(gpu_report.last_share(records)) if records else None
        rate = step_seconds(records, s.probe_steps) if len(records) > 1 else None
        tokens_step = tokens_per_step(s)
        rec.update(planned_steps=self.n_steps, steps=t.step, tokens=t.tokens,
                   flops=t.total_flops, train_s=t.elapsed, setup_s=setup_s, eval_s=eval_s,
                   wall_s=(ends[-1] - ends[0]) if ends else None,
                   tokens_per_s=tokens_step / rate if rate else None,
                   curve=evals, layers=intervals, layers_end=end,
                   config_yaml=t.cfg.to_yaml())
        summary = None
        if final and records:
            t.metrics.sync()  # the stages are read back from metrics.jsonl
            summary = run_summary(t.run_dir, rec.get("cut") or "reached the study's step budget",
                                  {"steps": t.step, "tokens": t.tokens, "flops": t.total_flops,
                                   "elapsed_s": t.elapsed}, t.model, t.model_cfg,
                                  t.controller.coeff if t.controller else None, records[-1],
                                  t.last_eval, t.run_dir / "final",
                                  stages=bool(t.model_cfg.uses_adaptive_reg))
            summary["final_dir"] = None  # no weights are written
            summary["whole_validation"] = rec.get("whole_validation")
            (t.run_dir / "summary.json").write_text(gpu_report.dumps(summary, indent=2))
        rec["files"] = {"metrics.jsonl": records, "eval.jsonl": [
            {k: v for k, v in e.items() if k not in ("flops", "eval_s")} for e in evals],
            "summary.json": summary}
        self.out.write_run(spec.name, rec)
        row.update(gpu_report.run_row(rec))
        self.save()
