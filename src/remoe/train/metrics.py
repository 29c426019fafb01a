"""What a run records and shows as it goes: the ``metrics.jsonl`` / ``eval.jsonl`` lines and the
training FLOPs they count, the routing masks of the calibration set, the progress a terminal (or a
log) shows, and at its end the summary (``summary.json``) and its text."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from remoe import rundir
from remoe.errors import ConfigError
from remoe.fileio import atomic_open
from remoe.machine import perf
from remoe.model.losses import no_expert_share_of
from remoe.model import registry
from remoe.model.spec import ModelSpec

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


# ----------------------------------------------------------------------------- FLOPs

@dataclass
class FlopCounter:
    """Training FLOPs counted from the experts that were actually active; ``spec``: the model
    config (``ReMoEConfig.spec``, or a model's ``model.spec``).

    Matmul FLOPs only (2 per multiply-add), after Narayanan et al. (2021): per token and layer
    the attention projections, the attention scores and values (``2 * 2 * S * D``), the router,
    and ``2 * 3 * D * H`` per active (token, expert) pair (SwiGLU has three projections); plus
    the LM head. A shared expert (``shared_expert_size`` S > 0) costs every token
    ``2 * 3 * D * S`` in each MoE layer, plus ``2 * D`` for its gate; attention biases and q/k
    norms are not matmuls. Training = 3x forward (backward costs two forwards). ReMoE is denser
    in stages I-II, so its FLOPs per step are higher there: this is what makes matched-compute
    comparisons possible (paper §4.3).
    """

    spec: ModelSpec
    seq_len: int

    def __post_init__(self) -> None:  # what a step's count needs, read once from the config
        self._kind = registry.resolve(self.spec.routing.router)
        self._fixed, self._pair = self._per_token_fixed(), self.expert_pair_flops()

    @property
    def _is_moe(self) -> bool:
        return bool(registry.declares(self.spec.routing.router, "is_moe"))

    def _per_token_fixed(self) -> float:
        b, r = self.spec.backbone, self.spec.routing
        D, L, dh = b.hidden_size, b.num_layers, b.head_dim
        attn_proj = D * (b.num_heads * dh) * 2 + D * (b.num_kv_heads * dh) * 2
        attn_scores = 2 * self.seq_len * b.num_heads * dh  # QK^T and AV
        kind = registry.resolve(r.router)
        moe = self._is_moe
        router = D * r.num_routed if moe and kind.has_router_weights else 0
        per_layer = 2 * (attn_proj + router) + 2 * attn_scores
        if moe and r.shared_expert_size:
            per_layer += 2 * (3 * D * r.shared_expert_size + (D if r.shared_expert_gate else 0))
        if not moe:
            per_layer += 2 * 3 * D * kind.width(self.spec)
        return L * per_layer + 2 * D * b.vocab_size

    def expert_pair_flops(self) -> float:
        """Forward FLOPs of one active (token, expert) pair."""
        b = self.spec.backbone
        return 2 * 3 * b.hidden_size * (b.ffn_hidden_size // self.spec.routing.granularity)

    def forward_flops(self, tokens: int, active_pairs: float) -> float:
        """Forward FLOPs of ``tokens`` tokens whose MoE layers used ``active_pairs`` pairs in all."""
        return tokens * self._fixed + active_pairs * self._pair

    def effective_pairs(self, counted_pairs: float, tokens: int) -> float:
        """Pairs that cost an expert computation. Lory reports every expert as used by every
        token but computes one merged expert per token (plus merging E experts per segment)."""
        return self._kind.effective_pairs(self.spec, counted_pairs, tokens)

    def train_flops(self, tokens: int, active_pairs: float) -> float:
        return 3.0 * self.forward_flops(tokens, active_pairs)


# ----------------------------------------------------------------------------- routing masks
# Recorded during training: the fixed calibration sequences they are taken on, and the
# ``routing/masks_STEP.npz`` files (bit-packed ``[L, T, N]``) ``remoe analyze`` reads, with the
# share of the calibration tokens routed to no expert in each layer (``no_expert_share``
# ``[L]``: the one expert-use number the step's counts cannot give).

def calibration_set(data, seq_len: int, calib_tokens: int) -> torch.Tensor | None:
    """About ``calib_tokens`` tokens of validation sequences, the domains interleaved so that
    every domain is kept (None: no validation data)."""
    n = max(1, math.ceil(calib_tokens / seq_len))  # sequences in the calibration set
    per_domain = max(1, math.ceil(n / max(1, len(data.domains))))
    rows = [ids[:, :seq_len] for ids, _ in data.eval_batches(
        "validation", seq_len=seq_len, batch_size=n, max_chunks_per_domain=per_domain)]
    if not rows:
        return None
    ids = torch.cat(rows)  # domain after domain
    return ids[round_robin(ids.shape[0], per_domain)][:n]


def round_robin(total: int, per_group: int) -> torch.Tensor:
    """Indices visiting consecutive groups of ``per_group`` rows in turn (one row each)."""
    idx = torch.arange(total)
    groups = (total + per_group - 1) // per_group
    key = (idx % per_group) * groups + idx // per_group
    return idx[key.argsort()]


def write_masks(run_dir: Path, step: int, masks: list[torch.Tensor],
                token_ids: torch.Tensor) -> Path:
    """Write one forward's masks (per MoE layer bool ``[T, N]``) atomically; returns the path."""
    masks_LTN = torch.stack([m.cpu() for m in masks]).numpy()
    path = run_dir / "routing" / f"masks_{step:07d}.npz"
    with atomic_open(path) as f:
        np.savez_compressed(f, masks=np.packbits(masks_LTN, axis=-1),
                            shape=np.array(masks_LTN.shape),
                            token_ids=token_ids.reshape(-1).numpy(), step=np.array(step),
                            no_expert_share=no_expert_share_of(masks_LTN))
    return path


@torch.no_grad()
def record_masks(model, calib: torch.Tensor, device, run_dir: Path, step: int, is_main: bool
                 ) -> None:
    """One forward of the calibration set with ``record_masks=True`` (every rank that takes
    part in it: a collective forward under expert parallelism or FSDP); rank 0 writes them."""
    model.eval()
    try:
        out = model(input_ids=calib.to(device), record_masks=True)
        if is_main:
            write_masks(run_dir, step, out.aux.masks, calib)
    finally:
        model.train()


# ----------------------------------------------------------------------------- progress
# What a run shows while it trains: a tqdm bar on a terminal, otherwise a progress line every
# ``train.log_every`` steps and at least every 30 s (step of the total, tokens/s since the
# previous line, ETA).

def stats_text(rec: dict[str, Any]) -> str:
    # lambda only where a controller steers one (a TopK or dense run's is always 0)
    lam = f"lambda {rec['lambda']:.2e}  " if rec.get("lambda") else ""
    return f"lm {rec['lm_loss']:.3f}  S {rec['sparsity']:.3f}  {lam}lr {rec['lr']:.2e}"


def open_progress(name: str, start_step: int, total: int, log_every: int, bar: bool,
                  main: bool):
    """The tqdm bar (``bar``: a terminal on the main rank), else None after announcing the lines."""
    if bar:
        from tqdm import tqdm

        return tqdm(total=total, initial=start_step, desc=name, dynamic_ncols=True)
    if main and log_every:
        print(f"training {name}: steps {start_step + 1}-{total}; a line every {log_every} steps "
              f"or 30 s (tokens/s since the previous line, ETA)", flush=True)
    return None


class ProgressLines:
    """The progress lines of a run without a terminal (e.g. ``remoe train > log 2>&1``)."""

    def __init__(self, total: int, every: int) -> None:
        self.total, self.every = total, every
        self.start: tuple[float, int, int] | None = None  # (wall time, step, tokens) before it
        self.last: tuple[float, int, int] | None = None

    def update(self, rec: dict[str, Any]) -> None:
        now, total = time.monotonic(), self.total
        if self.start is None:
            # the first step of a process carries one-time costs (allocation, lazy
            # initialisation, the thread tuner's first probe): the ETA counts from its end, so
            # it is not the first step's time multiplied by the steps left (that was ~8x high)
            step_s = rec["step_tokens"] / max(rec["tokens_per_s"], 1e-9)
            self.last = (now - step_s, rec["step"] - 1, rec["tokens"] - rec["step_tokens"])
            self.start = (now, rec["step"], rec["tokens"])
        every = self.every
        if not every or not (rec["step"] % every == 0 or rec["step"] in (1, total)
                             or now - self.last[0] >= 30.0):
            return
        t0, _, k0 = self.last
        rate = (rec["tokens"] - k0) / max(now - t0, 1e-9)
        print(f"step {rec['step']:>5}/{total} ({100 * rec['step'] / max(total, 1):3.0f}%)  "
              f"{stats_text(rec)}  {rate:,.0f} tok/s  ETA {self.eta(now, rec['step'])}",
              flush=True)
        self.last = (now, rec["step"], rec["tokens"])

    def eta(self, now: float, step: int) -> str:
        """Time left at the mean step time since the end of this process's first step."""
        ts, ss, _ = self.start
        if step >= self.total:
            return "0m00s"
        if step <= ss:
            return "after warm-up"
        left = (now - ts) / (step - ss) * (self.total - step)
        return f"{int(left // 60)}m{int(left % 60):02d}s"
