"""The run directory of ``remoe train`` and the defences that keep it consistent.

Layout (``runs/<name>/``; docs/ARCHITECTURE.md "Run directory")::

    .lock                        flock'ed by the one process writing the run; holds its PID
    config.yaml                  the resolved config (config.yaml.prev-<step>: before a resume)
    metrics.jsonl, eval.jsonl    one JSON object per line (never NaN/inf: null)
    checkpoints/step_<step:07d>/ checkpoint files + checksums.json (sha256 and size per file)
    checkpoints/LATEST           name of the newest checkpoint (resume verifies, not trusts, it)
    final/, summary.json

Defences: one writer at a time (:class:`RunLock`, a kernel ``flock``, released by the kernel
even after ``kill -9``); temporaries of interrupted writes (``.<name>.tmp*``) are removed when a
writer starts; a fresh run refuses a directory that holds a run (:func:`require_fresh`) unless
the old contents are archived (:func:`archive_contents`); every checkpoint is verified against
its manifest before a resume uses it (:func:`find_resumable`); a torn JSONL line is dropped
(:func:`read_jsonl`); a full disk is reported as such (:func:`writing`). This module knows no
trainer: it imports only the standard library, torch/safetensors, :mod:`remoe.errors` and its
two parts below.

Parts: :mod:`remoe.rundir.lock` (the lock, the fresh-run guard, leftovers of interrupted writes),
:mod:`remoe.rundir.files` (full-disk reporting, atomic writes, strict JSON, JSONL); this module
keeps the checksummed checkpoints and the verified resume, and re-exports the other two.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from remoe.model.bundle import file_sha256, write_checksums
from remoe.rundir.files import (DiskFullError, JsonlAppender, atomic_write_text, dumps_json,
                                finite_or_none, fsync_dir, fsync_tree, is_disk_full, read_jsonl,
                                say, temp_path, warn, writing)
from remoe.rundir.lock import (LOCK_FILE, RunLock, archive_contents, check_not_locked, contents,
                               is_temporary, remove_interrupted_writes, require_fresh)

__all__ = [  # the names this module has always offered (some now live in the modules above)
    "CHECKPOINT_RE", "DiskFullError", "JsonlAppender", "LATEST", "LOCK_FILE", "MANIFEST",
    "MANIFEST_KEY",
    "RunLock", "STATE_FILE", "WEIGHTS_FILE", "archive_contents", "atomic_write_text",
    "check_not_locked", "checkpoint_dirs", "contents", "dumps_json", "find_resumable",
    "finite_or_none", "is_disk_full", "is_temporary", "load_state", "read_jsonl", "read_latest",
    "remove_dir", "remove_interrupted_writes", "replace_dir", "require_fresh", "say",
    "set_aside", "temp_path", "verify_manifest", "warn", "write_manifest", "writing",
]

LATEST = "LATEST"
MANIFEST = "checksums.json"
STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"
DCP_METADATA = "dcp/.metadata"  # remoe.distributed.dcp
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
MANIFEST_KEY = "has_manifest"  # in every trainer state written with a manifest beside it


def write_manifest(ckpt_dir: Path) -> None:
    """``checksums.json``: size and sha256 of every file; written last, before the rename (the
    writer lives with the saved model's code: a re-saved model directory regenerates it)."""
    write_checksums(ckpt_dir)


def verify_manifest(ckpt_dir: Path, required: tuple[str, ...] = (WEIGHTS_FILE, STATE_FILE)) -> str | None:
    """None when every file matches ``checksums.json``; otherwise why not (one phrase)."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return f"missing {MANIFEST}"
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("files is not a mapping")
        for e in files.values():
            int(e["size"]), str(e["sha256"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    for name in required:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, e in files.items():
        p = ckpt_dir / name
        if not p.is_file():
            return f"missing file {name}"
        size = p.stat().st_size
        if size != int(e["size"]):
            return f"size mismatch of {name} ({size} bytes, expected {e['size']})"
        if file_sha256(p) != e["sha256"]:
            return f"checksum mismatch of {name}"
    return None


def checkpoint_dirs(ckpt_root: Path) -> list[Path]:
    """``step_*`` directories, newest (highest step) first."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir()
             if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def read_latest(ckpt_root: Path) -> tuple[str | None, str | None]:
    """``(name in LATEST, problem with it)``."""
    marker = ckpt_root / LATEST
    if not marker.exists():
        return None, "missing"
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"unreadable ({type(e).__name__})"
    if not CHECKPOINT_RE.match(name):
        return None, f"holds {name[:40]!r}, not a checkpoint name"
    if not (ckpt_root / name).is_dir():
        return name, f"names {name}, which does not exist"
    return name, None


def load_state(ckpt: Path) -> dict[str, Any]:
    import torch

    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)


def _load_weights(ckpt: Path) -> None:
    from safetensors.torch import load_file

    load_file(str(ckpt / WEIGHTS_FILE))


def find_resumable(ckpt_root: Path,
                   report: Callable[[str], None] | None = None,
                   ) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, its trainer state, and the newer ones skipped.

    A checkpoint verifies when its files match ``checksums.json`` and its trainer state loads.
    One without a manifest is accepted (when its weights and trainer state both load) only if
    it was written before manifests existed: never when its trainer state says a manifest was
    written (:data:`MANIFEST_KEY`) or another checkpoint of the run has one, so deleting
    ``checksums.json`` cannot switch the check off. ``report`` gets one line per
    skipped checkpoint and one when ``LATEST`` does not name the chosen one.
    """
    skipped: list[tuple[Path, str]] = []
    chosen, state = None, None
    # a run whose checkpoints carry manifests never trusts one of its own without one
    run_writes_manifests = ckpt_root.is_dir() and any(
        (p / MANIFEST).is_file() for p in ckpt_root.iterdir() if p.is_dir())
    for ckpt in checkpoint_dirs(ckpt_root):
        # a sharded (DCP, train.fsdp) checkpoint has dcp/ instead of model.safetensors
        sharded = (ckpt / "dcp").is_dir()
        reason = verify_manifest(ckpt, (DCP_METADATA, STATE_FILE) if sharded else
                                 (WEIGHTS_FILE, STATE_FILE))
        legacy = reason == f"missing {MANIFEST}"
        if reason is not None and not legacy:
            skipped.append((ckpt, reason))
            continue
        try:
            state = load_state(ckpt)
            if not isinstance(state, dict) or "step" not in state:
                raise ValueError("no step in it")
        except Exception as e:  # noqa: BLE001 - any failure means: not usable
            skipped.append((ckpt, f"unreadable {STATE_FILE} ({type(e).__name__})"))
            state = None
            continue
        if legacy and (run_writes_manifests or state.get(MANIFEST_KEY)):
            skipped.append((ckpt, f"missing {MANIFEST} (this run writes one with every "
                                  "checkpoint; one without it is not trusted)"))
            state = None
            continue
        if legacy:
            try:
                _load_weights(ckpt)
            except Exception as e:  # noqa: BLE001
                skipped.append((ckpt, f"no {MANIFEST} and unreadable {WEIGHTS_FILE} "
                                      f"({type(e).__name__})"))
                state = None
                continue
        chosen = ckpt
        break
    if report is not None:
        for ckpt, reason in skipped:
            report(f"--resume: skipped checkpoint {ckpt.name}: {reason}")
        latest, problem = read_latest(ckpt_root)
        if chosen is not None and (problem or latest != chosen.name):
            report(f"--resume: checkpoints/LATEST {problem or 'names ' + str(latest)}; using "
                   f"the newest complete checkpoint {chosen.name}")
        if chosen is not None and legacy:
            report(f"--resume: {chosen.name} has no {MANIFEST} (older format): checked by "
                   "loading it")
    return chosen, state, skipped


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint to ``damaged-<name>`` (kept for inspection, never resumed)."""
    dest = ckpt.with_name(f"damaged-{ckpt.name}")
    n = 1
    while dest.exists():
        n += 1
        dest = ckpt.with_name(f"damaged-{ckpt.name}-{n}")
    os.replace(ckpt, dest)
    return dest


def remove_dir(path: Path) -> None:
    """Delete a directory so that an interruption leaves only a temporary behind."""
    doomed = path.with_name(f".{path.name}.tmp-delete{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished directory ``tmp`` at ``final`` (the old one, if any, is removed).
    Durable on return: every file of ``tmp`` is fsync'ed before the rename and the parent
    directory after it, so a power loss never leaves a named checkpoint with empty files."""
    fsync_tree(tmp)
    if final.exists():
        remove_dir(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
