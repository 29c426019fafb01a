"""Checkpoints: atomic writes, keep-last-N, and loading a model from any run/checkpoint/HF dir.

A checkpoint directory is a Hugging Face ``save_pretrained`` directory (``model.safetensors`` +
``config.json``) plus ``tokenizer.json`` and ``trainer_state.pt`` (optimizer, scheduler, lambda
controller, RNG states, data position). It is written into a temporary sibling directory and
renamed into place, then ``LATEST`` is replaced atomically: an interrupted write never leaves a
half checkpoint that ``--resume`` would pick up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from remoe.errors import ConfigError

LATEST = "LATEST"
STATE_FILE = "trainer_state.pt"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_model_dir(final: Path, model, tokenizer_path: str | os.PathLike | None,
                    state: dict[str, Any] | None = None) -> Path:
    """Write an HF model directory (+ tokenizer.json, + trainer state) atomically to ``final``."""
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    unwrap(model).save_pretrained(tmp, safe_serialization=True)
    if tokenizer_path:
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    if state is not None:
        torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def save_checkpoint(ckpt_root: Path, step: int, model, state: dict[str, Any],
                    tokenizer_path: str | None, keep_last: int) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically, point LATEST at it, prune old ones."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    final = write_model_dir(ckpt_root / name, model, tokenizer_path, state)
    atomic_write_text(ckpt_root / LATEST, name)
    if keep_last > 0:
        done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    marker = ckpt_root / LATEST
    if not marker.exists():
        return None
    path = ckpt_root / marker.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)


def unwrap(model):
    """The ReMoEForCausalLM inside a DDP wrapper."""
    return getattr(model, "module", model)


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
