"""What a run writes as it goes: ``metrics.jsonl`` / ``eval.jsonl`` lines and the end-of-run
summary text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remoe import rundir

#: metrics.jsonl keys that measure the machine rather than the run's state: they differ between
#: two runs of one config (and between a run and its resume) while every other number is equal.
#: ``threads`` belongs here because the auto thread count is chosen by timing, and the model's
#: results do not depend on it (checked bit for bit at 1 and 2 threads).
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

    def close(self) -> None:
        self.out.close()


def format_summary(s: dict[str, Any]) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        f"run          {s['run_dir']}  ({s['stop_reason']})",
        f"router       {s['router']}   params total {s['params_total'] / 1e6:.2f}M, "
        f"active {s['params_active'] / 1e6:.2f}M",
        f"trained      {s['steps']} steps, {s['tokens']:,} tokens, {s['flops']:.3g} FLOPs, "
        f"{s['elapsed_s']:.0f} s ({f(s['tokens_per_s'], ',.0f')} tokens/s)",
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
