"""The runs of one GPU study (:mod:`remoe.lab.study.gpu_study`), one after the other: each
trained with the trainer's own step, evaluated at the plan's steps, written after every
evaluation."""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError
from remoe.lab.study import gpu_record, gpu_report
from remoe.lab.study.gpu_plan import (RUNS, GPURun, Settings, base_sets, eval_steps,
                                      plan_steps, step_seconds, tokens_per_step)


class Study:
    """The runs of one study, their plan and what is written after every evaluation."""

    def __init__(self, s: Settings, bundle, out: gpu_record.Output, work_dir: Path,
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
                        **env, "settings": dataclasses.asdict(s), "data": data_info,
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
                stats = gpu_record.layer_stats([x for x in records if x["step"] > last_eval_step])
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
        from remoe.method.losses import evaluate_loss

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
        end = gpu_record.layer_stats(gpu_record.last_share(records)) if records else None
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
            (t.run_dir / "summary.json").write_text(gpu_record.dumps(summary, indent=2))
        rec["files"] = {"metrics.jsonl": records, "eval.jsonl": [
            {k: v for k, v in e.items() if k not in ("flops", "eval_s")} for e in evals],
            "summary.json": summary}
        self.out.write_run(spec.name, rec)
        row.update(gpu_report.run_row(rec))
        self.save()
