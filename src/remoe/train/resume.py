"""Starting a run in its directory: fresh or resumed.

The run directory defends itself (:mod:`remoe.rundir`): one writer (a lock), no leftovers of
interrupted writes, no fresh run over an old one, and only verified checkpoints resumed, with a
config that may differ from the checkpointed one only where that is safe. Loading a checkpoint's
weights refuses a model config that does not match them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from remoe import rundir
from remoe.distributed import dcp
from remoe.errors import ConfigError
from remoe.train import checkpoint as ckpt_io


def start_run_dir(run_dir: Path, cfg, resume: bool, is_main: bool, barrier: Callable[[], None],
                  model_cfg=None
                  ) -> tuple[rundir.RunLock | None, Path | None, dict[str, Any] | None]:
    """Lock ``run_dir`` (main rank), check it, and find the checkpoint to resume (every rank).

    Returns ``(lock, checkpoint or None, its trainer state or None)``; on failure the lock is
    released before raising."""
    ckpt_root = run_dir / "checkpoints"
    lock, resume_from, state = None, None, None
    try:
        if is_main:
            lock = rundir.RunLock.acquire(run_dir)
            rundir.remove_interrupted_writes(run_dir)
            if resume:
                resume_from, state = ckpt_io.find_resume_checkpoint(ckpt_root)
                if resume_from is not None:
                    ckpt_io.check_resume_config(run_dir, cfg.to_dict(), cfg.to_yaml(),
                                                int(state["step"]), resume_from, model_cfg)
            else:
                rundir.require_fresh(run_dir)
        barrier()
        if resume and not is_main:
            resume_from, state = ckpt_io.find_resume_checkpoint(ckpt_root, report=False)
        if resume and resume_from is None:
            raise ConfigError(f"--resume: no checkpoint found under {ckpt_root}")
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, resume_from, state


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], ckpt: Path) -> None:
    """``model.load_state_dict(weights)``, refusing (ConfigError) weights of another config."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # size mismatch: the model config changed
        first = str(e).strip().splitlines()[1:2] or [str(e)[:200]]
        raise ConfigError(f"--resume: checkpoint {ckpt} does not match the model config "
                          f"({first[0].strip()})") from None
    if unexpected or [m for m in missing if m in dict(model.named_parameters())]:
        raise ConfigError(f"--resume: checkpoint {ckpt} does not match the model config "
                          f"(missing={missing[:3]}, unexpected={unexpected[:3]})")


def logged_eval(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The last ``eval.jsonl`` record of ``step`` (a finished run's, or a run stopped after its
    last checkpoint, validation is on disk: finishing again must not repeat it)."""
    path = run_dir / "eval.jsonl"
    evals, _ = rundir.read_jsonl(path) if path.exists() else ([], [])
    done = [rec for _, rec in evals if rec.get("step") == step]
    return done[-1] if done else None


def load_full_checkpoint(ckpt: Path, state: dict[str, Any], model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer, ep, device: torch.device) -> None:
    """Weights and optimizer state of a full (not sharded) checkpoint; under expert parallelism
    (``ep``) each rank keeps its slices of the experts the checkpoint holds in full."""
    from safetensors.torch import load_file

    ckpt_io.require_optimizer_state(ckpt, state)
    weights = load_file(str(ckpt / "model.safetensors"), device=str(device))
    optimizer_state = state["optimizer"]
    if ep is not None:
        weights = ep.shard_state_dict(weights)
        optimizer_state = ep.shard_optimizer_state(optimizer_state, optimizer)
    load_weights(model, weights, ckpt)
    optimizer.load_state_dict(optimizer_state)


def load_checkpoint(ckpt: Path, state: dict[str, Any], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, ep, fsdp, device: torch.device) -> None:
    """Weights and optimizer state of ``ckpt``: under FSDP sharded, every rank reading its
    shards (any world size; :mod:`remoe.distributed.dcp`), else :func:`load_full_checkpoint`."""
    dcp.check_checkpoint_kind(ckpt, fsdp is not None)
    if fsdp is not None:
        dcp.load_sharded(ckpt, model, optimizer, ep)
    else:
        load_full_checkpoint(ckpt, state, model, optimizer, ep, device)


def restore_last_record(metrics, state: dict[str, Any], step: int) -> None:
    """The checkpointed step's metrics line (``state["last_record"]``), written back through
    ``metrics`` (a MetricsWriter) when metrics.jsonl lost it (a line torn by a crash): the
    summary and the plots read it."""
    rec = state.get("last_record")
    have = metrics.last
    if isinstance(rec, dict) and rec.get("step") == step and (
            have is None or have.get("step") != step):
        metrics.write(rec)
        rundir.say(f"--resume: metrics.jsonl had lost the line of step {step}; restored it "
                   "from the checkpoint")
