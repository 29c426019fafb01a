"""What the study's children are and what their run directories say: the ``remoe train`` and
``remoe eval`` command lines, the config comparison that keeps a run directory to one
experiment, small tolerant readers, and the child's death with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from remoe import fileio
from remoe.lab.study.runconfig import load_run_config

#: Config fields that may differ between two runs of the same experiment: threads (they follow
#: --jobs) and where the run lives (a run taken over with ``remoe study --reuse`` keeps the name
#: and directory it was trained under).
NOT_THE_EXPERIMENT = (("train", "num_threads"), ("run", "name"), ("run", "out_dir"))


def default_command(config_path: Path, flags: list[str]) -> list[str]:
    """``python -m remoe.cli train CONFIG --no-progress [--resume | --overwrite]``."""
    return [sys.executable, "-m", "remoe.cli", "train", str(config_path), "--no-progress", *flags]


def eval_command(run_dir: Path, tasks: str, limit: int | None, loss: bool = False) -> list[str]:
    """``python -m remoe.cli eval RUN --tasks TASKS [--no-loss] [--limit N]`` (results in
    ``RUN/eval_results.json``). Without ``loss`` the validation loss is the trainer's final
    evaluation (its fixed sample); with it, ``remoe eval`` adds the loss over the whole split."""
    return [sys.executable, "-m", "remoe.cli", "eval", str(run_dir), "--tasks", tasks,
            *([] if loss else ["--no-loss"]), *(["--limit", str(limit)] if limit else [])]


def eval_done(run_dir: Path, tasks: str, limit: int | None, loss: bool = False) -> bool:
    """``RUN/eval_results.json`` has zero-shot results of ``tasks`` at ``limit`` (and, with
    ``loss``, the whole-split validation loss)."""
    doc = read_json(run_dir / "eval_results.json")
    if not doc or (doc.get("tasks") or {}).get("selection") != tasks or doc.get("limit") != limit:
        return False
    models = doc.get("models") or []
    if loss and not any(m.get("loss") for m in models):
        return False
    return any(m.get("zero_shot") for m in models)


def same_experiment(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as the experiment loader resolves it, minus the fields that do not change the
    experiment (threads, where the run lives; the data cache is compared by its real path: a
    symlinked checkout reads the same files). Two runs equal under it trained the same model on
    the same data with the same seed, whichever study made them."""
    exp = load_run_config(cfg)
    d = exp.to_dict()
    for section, key in NOT_THE_EXPERIMENT:
        d.get(section, {}).pop(key, None)
    if d.get("data", {}).get("cache_dir"):
        d["data"]["cache_dir"] = os.path.realpath(d["data"]["cache_dir"])
    # the model as built (preset and defaults applied): `granularity: 1` written out or left
    # to its default is the same model
    d["model"] = exp.model_config(vocab_size=exp.data.vocab_size).to_dict()
    d["model"].pop("transformers_version", None)
    return d


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section) or {}, b.get(section) or {}
        # a key on one side only is a router's option that comes and goes with model.router
        # (or a field of another version): the keys both configs hold decide
        for key in sorted(set(sa) & set(sb)):
            if sa[key] != sb[key]:
                out.append(f"{section}.{key}: {sa.get(key)!r} -> {sb.get(key)!r}")
    return out


def read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return d if isinstance(d, dict) else None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if missing, unreadable or not an object."""
    d = fileio.read_json(path)
    return d if isinstance(d, dict) else None


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the study process dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def tail(path: Path, n: int = 12) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
