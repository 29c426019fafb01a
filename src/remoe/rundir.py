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
trainer: it imports only the standard library, torch/safetensors and :mod:`remoe.errors`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from remoe.errors import ConfigError

LOCK_FILE = ".lock"
LATEST = "LATEST"
MANIFEST = "checksums.json"
STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
# what an interrupted write leaves behind: .step_*.tmp<pid>, .final.tmp<pid>, .<file>.tmp<pid>,
# .masks_<step>.tmp.npz, .step_*.tmp-delete (a prune in progress)
_TEMP_RE = re.compile(r"^\..+\.tmp")
_DISK_FULL_TEXT = ("no space left", "storagefull", "os error 28", "disk quota")


class DiskFullError(ConfigError):
    """The file system filled up while writing part of a run (nothing half-written is kept)."""


def say(msg: str) -> None:
    """One line on stderr about what the run directory code did."""
    print(f"remoe train: {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"remoe train: warning: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the lock

def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _busy(run_dir: Path, holder: int | None) -> ConfigError:
    who = f"pid {holder}" if holder else "another process"
    return ConfigError(f"run directory {run_dir} is in use by {who} (a remoe train writing it); "
                       "wait for it to finish or choose another run.name")


class RunLock:
    """Exclusive ``flock`` on ``<run_dir>/.lock`` (the file holds the writer's PID).

    The kernel drops the lock when its holder dies, whatever the signal; a PID left in the file
    by a dead holder is taken over with a warning. A second acquisition by the process that
    already holds the lock (two Trainer objects in one program) is allowed and owns nothing.
    """

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> "RunLock":
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise ConfigError(f"run directory {run_dir} cannot be created: {e.strerror} "
                              f"({e.filename})") from None
        path = run_dir / LOCK_FILE
        with writing(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            if holder == os.getpid():
                return cls(path, None)
            raise _busy(run_dir, holder) from None
        previous = _read_pid(fd)
        if previous is not None and previous != os.getpid():
            why = "no longer running" if not _alive(previous) else "it no longer holds the lock"
            warn(f"took over the stale lock of {run_dir} left by pid {previous} ({why})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock and clear the PID (a clean exit leaves no stale lock behind)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def check_not_locked(run_dir: Path) -> None:
    """Fail fast (before any data or model work) when another process writes ``run_dir``."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # the real acquisition will say what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        if holder != os.getpid():
            raise _busy(run_dir, holder) from None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- contents

def is_temporary(name: str) -> bool:
    return bool(_TEMP_RE.match(name))


def remove_interrupted_writes(run_dir: Path) -> list[str]:
    """Delete what interrupted writes left (call with the lock held); returns their paths."""
    removed = []
    for d in (run_dir, run_dir / "checkpoints", run_dir / "final", run_dir / "routing"):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if not is_temporary(p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(str(p.relative_to(run_dir)))
    if removed:
        more = f" (+{len(removed) - 4} more)" if len(removed) > 4 else ""
        say(f"removed {len(removed)} leftover(s) of interrupted writes in {run_dir}: "
            f"{', '.join(removed[:4])}{more}")
    return removed


def contents(run_dir: Path) -> list[str]:
    """What ``run_dir`` holds, besides its lock file and temporaries of interrupted writes."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir()
                  if p.name != LOCK_FILE and not is_temporary(p.name))


def require_fresh(run_dir: Path) -> None:
    """A run without ``--resume`` must start in an empty (or new) directory."""
    held = contents(run_dir)
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"run directory {run_dir} already holds a run ({shown}); continue it "
                          "with --resume, or start over with --overwrite (moves the old contents "
                          f"to {run_dir.name}.old-<time>)")


def archive_contents(run_dir: Path) -> Path | None:
    """Move everything in ``run_dir`` (but its lock) to a new ``<run_dir>.old-<time>``."""
    held = contents(run_dir)
    if not held:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    dest.mkdir()
    for name in held:
        os.replace(run_dir / name, dest / name)
    remove_interrupted_writes(run_dir)
    return dest


# ----------------------------------------------------------------------------- writing

def is_disk_full(exc: BaseException, where: Path | None = None) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception chain (torch and safetensors wrap it in their own
    errors), or a file system with less than 1 MiB left after the failure."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e).lower() for t in _DISK_FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    if where is not None:
        probe = where
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < (1 << 20)
    return False


@contextmanager
def writing(path: Path, cleanup: Path | None = None) -> Iterator[None]:
    """Run a write of ``path``: on failure remove ``cleanup`` (its temporary) and turn a full
    disk into :class:`DiskFullError` ("disk full while writing <path>")."""
    try:
        yield
    except BaseException as e:
        full = isinstance(e, Exception) and is_disk_full(e, cleanup or path)
        if cleanup is not None:
            if cleanup.is_dir() and not cleanup.is_symlink():
                shutil.rmtree(cleanup, ignore_errors=True)
            else:
                try:
                    cleanup.unlink(missing_ok=True)
                except OSError:
                    pass
        if full and not isinstance(e, DiskFullError):
            raise DiskFullError(f"disk full while writing {path}") from None
        raise


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary sibling and an atomic rename."""
    tmp = temp_path(path)
    with writing(path, cleanup=tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN/inf float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON: NaN/inf become null, anything else non-finite is an error."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_jsonl(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[int]]:
    """``(lines with their records, numbers of the lines that do not parse)``: a line torn by a
    kill during a write is reported instead of raised."""
    good, bad = [], []
    raw = path.read_bytes().decode("utf-8", "replace")
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=_reject_constant)
        except ValueError:
            bad.append(i)
            continue
        if isinstance(rec, dict):
            good.append((line, rec))
        else:
            bad.append(i)
    return good, bad


class JsonlAppender:
    """Appends whole lines with ``os.write`` (no buffer left to flush after an error)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with writing(path):
            self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                          | os.O_CLOEXEC, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        data = (dumps_json(record) + "\n").encode()
        with writing(self.path):
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------- checkpoints

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path) -> None:
    """``checksums.json``: size and sha256 of every file; written last, before the rename."""
    files = {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(ckpt_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (ckpt_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


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
        if _sha256(p) != e["sha256"]:
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
    One without a manifest (written before manifests existed, or whose manifest was deleted)
    is accepted when its weights and trainer state both load. ``report`` gets one line per
    skipped checkpoint and one when ``LATEST`` does not name the chosen one.
    """
    skipped: list[tuple[Path, str]] = []
    chosen, state = None, None
    for ckpt in checkpoint_dirs(ckpt_root):
        reason = verify_manifest(ckpt)
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
    """Put the finished directory ``tmp`` at ``final`` (the old one, if any, is removed)."""
    if final.exists():
        remove_dir(final)
    os.replace(tmp, final)
