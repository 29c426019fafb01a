"""Reading a model from a run directory, a checkpoint directory or any Hugging Face directory.

A neutral layer: ``remoe train``, ``remoe eval``, ``remoe analyze`` and ``remoe study`` all
use it, and it imports none of them (it sits on :mod:`remoe.rundir` and the model).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from remoe import dcpread, rundir
from remoe.errors import ConfigError

STATE_FILE = rundir.STATE_FILE
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


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
    """Load a model from a run/checkpoint/HF directory: returns ``(model, tokenizer_path|None)``.

    A sharded checkpoint (``train.fsdp=true``: ``dcp/`` instead of ``model.safetensors``) is
    read in this one process through :mod:`remoe.dcpread` (nothing in its files can run)."""
    from remoe.model import ReMoEForCausalLM

    d = resolve_model_dir(path)
    if dcpread.is_sharded(d):  # a checkpoint of a train.fsdp run: config.json + dcp/ shards
        from remoe.config import ReMoEConfig

        model = ReMoEForCausalLM(ReMoEConfig.from_pretrained(d))
        dcpread.load_model_weights(model, d)
        model = model.to(device).eval()
    elif not any((d / f).is_file() for f in _WEIGHT_FILES):
        raise ConfigError(f"{d} has a config.json but no weights ({' or '.join(_WEIGHT_FILES)} "
                          "or dcp/); point at a run, a checkpoint or a saved model directory")
    else:
        model = ReMoEForCausalLM.from_pretrained(d).to(device).eval()
    tok = d / "tokenizer.json"
    if not tok.exists() and (d.parent.parent / "final" / "tokenizer.json").exists():
        tok = d.parent.parent / "final" / "tokenizer.json"
    return model, (str(tok) if tok.exists() else None)
