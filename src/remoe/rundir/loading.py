"""Reading a model from a run directory, a checkpoint directory or any Hugging Face directory.

A neutral layer: ``remoe train``, ``remoe eval``, ``remoe analyze`` and ``remoe study`` all
use it, and it imports none of them (it sits on :mod:`remoe.rundir` and the model).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from remoe import rundir
from remoe.rundir import dcpread
from remoe.errors import ConfigError

STATE_FILE = rundir.STATE_FILE
_PIN_TRIES = 10
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


def _in_run(d: Path) -> bool:
    """A directory a training run may remove or replace while it is read (pruning of old
    checkpoints, ``final/`` written again)."""
    return d.parent.name == "checkpoints" or d.name == "final"


def _snapshot(src: Path, dst: Path) -> None:
    """Hard-link (copy across file systems) every file of ``src`` into ``dst``: the links keep
    the files whatever happens to ``src`` afterwards. FileNotFoundError: ``src`` went away."""
    if not src.is_dir():
        raise FileNotFoundError(src)
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            shutil.copy2(p, target)  # another file system, or links not allowed


@contextmanager
def pinned_model_dir(path: str | os.PathLike) -> Iterator[tuple[Path, Path]]:
    """``(the directory path resolves to, a directory to read it from)``.

    For a checkpoint or ``final/`` of a run (which a training run still writing it may prune or
    replace at any moment) the second is a private snapshot: hard links to its files (copies
    across file systems), verified against its ``checksums.json``, removed on exit. When the
    checkpoint disappears while it is taken, the run's newest one is taken instead (a run
    directory) or the error says what happened (a checkpoint named directly)."""
    last: Exception | None = None
    for _ in range(_PIN_TRIES):
        d = resolve_model_dir(path)
        if not _in_run(d):
            yield d, d
            return
        snap = Path(tempfile.mkdtemp(prefix="remoe-pin-"))
        try:
            try:
                _snapshot(d, snap / "model")
            except FileNotFoundError as e:  # pruned while linking: take the newest again
                last = e
                continue
            pinned = snap / "model"
            run_tok = _run_tokenizer(d)
            if not (pinned / "tokenizer.json").exists() and run_tok is not None:
                try:  # (a checkpoint without one reads the run's)
                    _snapshot_file(run_tok, pinned / "tokenizer.json")
                except FileNotFoundError:
                    pass
            if (pinned / rundir.MANIFEST).is_file():
                why = rundir.verify_manifest(pinned, required=())
                if why is not None:
                    raise ConfigError(f"{d} does not verify ({why}); evaluate another "
                                      "checkpoint of the run")
            yield d, pinned
            return
        finally:
            shutil.rmtree(snap, ignore_errors=True)
    raise ConfigError(f"checkpoint={str(path)!r}: {Path(str(last)).name if last else 'it'} was "
                      f"removed while it was read {_PIN_TRIES} times (a training run pruning "
                      "its checkpoints); name a checkpoint it keeps (train.keep_last) or its "
                      "final/")


def _snapshot_file(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        shutil.copy2(src, dst)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Load a model from a run/checkpoint/HF directory: returns ``(model, tokenizer_path|None)``.

    A sharded checkpoint (``train.fsdp=true``: ``dcp/`` instead of ``model.safetensors``) is
    read in this one process through :mod:`remoe.rundir.dcpread` (nothing in its files can run)."""
    with pinned_model_dir(path) as (orig, d):  # a live run may prune it while it loads
        model = _load(d, device)
    tok = orig / "tokenizer.json"  # (a caller that needs it to stay holds a pinned_model_dir)
    if not tok.exists():
        tok = _run_tokenizer(orig)
    return model, (str(tok) if tok is not None and tok.exists() else None)


def _run_tokenizer(ckpt: Path) -> Path | None:
    """The tokenizer of the run a checkpoint without one (a sharded one) belongs to: the run's
    own copy (``<run>/tokenizer.json``), else its ``final/``'s."""
    if ckpt.parent.name != "checkpoints":
        return None
    run = ckpt.parent.parent
    for p in (run / "tokenizer.json", run / "final" / "tokenizer.json"):
        if p.is_file():
            return p
    return None


def _load(d: Path, device: str | torch.device):
    from remoe.model import ReMoEForCausalLM

    if dcpread.is_sharded(d):  # a checkpoint of a train.fsdp run: config.json + dcp/ shards
        from remoe.model.config import ReMoEConfig

        model = ReMoEForCausalLM(ReMoEConfig.from_pretrained(d))
        dcpread.load_model_weights(model, d)
        model = model.to(device).eval()
    elif not any((d / f).is_file() for f in _WEIGHT_FILES):
        raise ConfigError(f"{d} has a config.json but no weights ({' or '.join(_WEIGHT_FILES)} "
                          "or dcp/); point at a run, a checkpoint or a saved model directory")
    else:
        import pickle

        try:  # (transformers reads a .bin with torch.load(weights_only=True): nothing runs)
            from remoe.rundir.bars import no_hf_bars

            with no_hf_bars():
                model = ReMoEForCausalLM.from_pretrained(d).to(device).eval()
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"{d}: the model's files could not be read ({type(e).__name__}: "
                              f"{first}); a damaged, foreign or crafted file (nothing from it "
                              "was run)") from None
    return model
