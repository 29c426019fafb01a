"""What a run writes as it goes: ``metrics.jsonl`` / ``eval.jsonl`` lines, and at its end the
summary (``summary.json``) and its text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from remoe import rundir
from remoe.machine import perf
from remoe.errors import ConfigError

#: metrics.jsonl keys that measure the machine rather than the run's state: they differ between
#: two runs of one config (and between a run and its resume) while every other number is equal.
#: ``threads`` belongs here as a setting of the machine, not a result: the default fixes it at
#: the run's start and a resume reuses it (remoe.machine.threads); the same count gives the same
#: bits, and whether another count does depends on the CPU.
MACHINE_KEYS = ("tokens_per_s", "elapsed_s", "threads")


def without_machine_keys(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with the :data:`MACHINE_KEYS` removed: what a bit-exact resume must match."""
    return [{k: v for k, v in r.items() if k not in MACHINE_KEYS} for r in records]


class MetricsWriter:
    """Append-only JSONL, one whole line per record (NaN/inf written as null).

    On resume, the lines of steps <= ``resume_step`` are kept; a line that does not parse (torn
    by a kill during a write) is dropped with a warning. ``last`` is the last record kept.
    """

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        self.last: dict[str, Any] | None = None
        if resume_step is not None and path.exists():
            lines, bad = rundir.read_jsonl(path)
            if bad:
                rundir.warn(f"dropped {len(bad)} unreadable line(s) of {path} (line "
                            f"{', '.join(map(str, bad[:5]))}; torn by an interrupted write)")
            keep = [(ln, rec) for ln, rec in lines if rec.get("step", 0) <= resume_step]
            rundir.atomic_write_text(path, "".join(ln + "\n" for ln, _ in keep))
            self.last = keep[-1][1] if keep else None
        elif resume_step is None and path.exists():
            path.unlink()
        self.out = rundir.JsonlAppender(path)

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(record)
        self.last = record

    def sync(self) -> None:
        """fsync the lines written so far (a resume keeps those up to its checkpoint)."""
        self.out.sync()

    def close(self) -> None:
        self.out.close()


def open_tensorboard(run_dir: Path):
    """A TensorBoard writer on ``run_dir/tensorboard`` (``train.tensorboard=true``)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise ConfigError("train.tensorboard=true needs the tensorboard package "
                          "(pip install tensorboard)") from e
    return SummaryWriter(str(run_dir / "tensorboard"))


def last_logged(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The ``metrics.jsonl`` record of ``step`` if it is the last one logged (else None)."""
    path = run_dir / "metrics.jsonl"
    logged = [rec for _, rec in (rundir.read_jsonl(path)[0] if path.exists() else [])]
    return logged[-1] if logged and logged[-1].get("step") == step else None


def logged_stages(run_dir: Path, target_sparsity: float):
    """Stage boundaries of the logged run (the definitions of ``remoe analyze stages``); None
    without records or where the router fixes the sparsity (nothing settles)."""
    from remoe.method.stages import detect_stages

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    if not recs:
        return None
    st = detect_stages([r["step"] for r in recs], [r["sparsity"] for r in recs],
                       target_sparsity, [r["lambda"] * r["reg_loss"] for r in recs],
                       [r["lm_loss"] for r in recs])
    return None if st.fixed else st


def run_summary(run_dir: Path, reason: str, totals: dict[str, Any], model, model_cfg,
                final_lambda: float | None, last: dict[str, Any] | None,
                last_eval: dict[str, Any] | None, final_dir: Path,
                stages: bool) -> dict[str, Any]:
    """The end-of-run summary. ``totals``: ``steps``, ``tokens``, ``flops``, ``elapsed_s``;
    ``last``: the last step's metrics record (None: read it back from ``metrics.jsonl``);
    ``stages``: detect the stage boundaries from ``metrics.jsonl``."""
    if last is None:  # the loop ran no step (resume of a finished run): the logged last step
        last = last_logged(run_dir, totals["steps"])
    r = model_cfg.routing
    found = logged_stages(run_dir, r.target_sparsity) if stages else None
    elapsed = totals["elapsed_s"]
    ceiling = perf.quick_ceiling_gflops()  # MFU against this machine's measured matmul rate
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return {
        "matmul_ceiling_gflops": ceiling,
        "mfu": perf.mfu(totals["flops"], elapsed, ceiling, world),
        "run_dir": str(run_dir), "stop_reason": reason, "steps": totals["steps"],
        "tokens": totals["tokens"], "flops": totals["flops"], "elapsed_s": elapsed,
        "tokens_per_s": totals["tokens"] / elapsed if elapsed else None,
        "router": r.router,
        "params_total": model.num_parameters(),
        "params_active": model.num_parameters(active=True),
        "target_sparsity": r.target_sparsity if model_cfg.is_moe else None,
        "final_lm_loss": last["lm_loss"] if last else None,
        "final_sparsity": last["sparsity"] if last else None,
        "final_lambda": final_lambda,
        "stage2_start": found.stage2_start if found else None,
        "settling_step": found.settle_step if found else None,
        "val_loss": last_eval["val_loss"] if last_eval else None,
        "val_domains": last_eval["domains"] if last_eval else None,
        "final_dir": str(final_dir),
    }


def format_summary(s: dict[str, Any]) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        f"run          {s['run_dir']}  ({s['stop_reason']})",
        f"router       {s['router']}   params total {s['params_total'] / 1e6:.2f}M, "
        f"active {s['params_active'] / 1e6:.2f}M",
        f"trained      {s['steps']} steps, {s['tokens']:,} tokens, {s['flops']:.3g} FLOPs, "
        f"{s['elapsed_s']:.0f} s ({f(s['tokens_per_s'], ',.0f')} tokens/s)",
        f"MFU          {f(s.get('mfu'), '.3f')} of the measured fp32 matmul ceiling "
        f"({f(s.get('matmul_ceiling_gflops'), '.1f')} GFLOP/s per process; whole run, "
        "eval and checkpoints included)",
        f"final loss   train LM {f(s['final_lm_loss'], '.4f')}, validation {f(s['val_loss'], '.4f')}",
    ]
    if s.get("val_domains"):
        lines.append("per domain   " + ", ".join(f"{k} {v:.3f}" for k, v in s["val_domains"].items()))
    if s["target_sparsity"] is not None:
        lines.append(f"sparsity     {f(s['final_sparsity'], '.4f')} (target "
                     f"{s['target_sparsity']:.4f})   lambda {f(s['final_lambda'], '.3e')}   "
                     f"settled at step {f(s['settling_step'], 'd')}")
    lines.append(f"outputs      metrics {s['run_dir']}/metrics.jsonl, model {s['final_dir']}")
    return "\n".join(lines)
