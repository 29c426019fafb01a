"""Reading a model from a run directory, a checkpoint directory or any Hugging Face directory.

A neutral layer: ``remoe train``, ``remoe eval``, ``remoe analyze`` and ``remoe study`` all
use it, and it imports none of them (it sits on :mod:`remoe.rundir` and the model).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from remoe import rundir
from remoe.errors import ConfigError

STATE_FILE = rundir.STATE_FILE


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint LATEST names, else the newest one holding a trainer state (no hashing:
    for reading a model; ``--resume`` uses :func:`find_resume_checkpoint`)."""
    name, problem = rundir.read_latest(ckpt_root)
    if problem is None and (ckpt_root / name / STATE_FILE).exists():
        return ckpt_root / name
    for ckpt in rundir.checkpoint_dirs(ckpt_root):
        if (ckpt / STATE_FILE).exists():
            return ckpt
    return None


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A run dir (its ``final/`` else LATEST checkpoint), a checkpoint dir, or an HF dir."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint={str(p)!r} does not exist")
    if (p / "config.json").exists():
        return p
    if (p / "final" / "config.json").exists():
        return p / "final"
    ckpt = latest_checkpoint(p / "checkpoints")
    if ckpt is not None:
        return ckpt
    raise ConfigError(f"checkpoint={str(p)!r} holds no model (expected config.json, final/ or "
                      "checkpoints/LATEST)")


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load a model from a run/checkpoint/HF directory: returns ``(model, tokenizer_path|None)``."""
    from remoe.model import ReMoEForCausalLM

    d = resolve_model_dir(path)
    model = ReMoEForCausalLM.from_pretrained(d).to(device).eval()
    tok = d / "tokenizer.json"
    if not tok.exists() and (d.parent.parent / "final" / "tokenizer.json").exists():
        tok = d.parent.parent / "final" / "tokenizer.json"
    return model, (str(tok) if tok.exists() else None)
