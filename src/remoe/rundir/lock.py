"""One writer per run directory, and a fresh run only in an empty one.

:class:`RunLock` (a kernel ``flock`` on ``<run>/.lock``, released even after ``kill -9``),
:func:`check_not_locked` (fail fast), :func:`remove_interrupted_writes` (temporaries left by
killed writes), :func:`require_fresh` and :func:`archive_contents` (``--overwrite``).

A low module: the standard library, :mod:`remoe.errors` and :mod:`remoe.rundir.files`. See
:mod:`remoe.rundir`.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from pathlib import Path

from remoe.errors import ConfigError
from remoe.rundir.files import say, warn, writing

LOCK_FILE = ".lock"
# what an interrupted write leaves behind: .step_*.tmp<pid>, .final.tmp<pid>, .<file>.<random>.tmp
# (remoe.fileio; .<file>.tmp<pid> before it), .step_*.tmp-delete (a prune in progress)
_TEMP_RE = re.compile(r"^\..+\.tmp")


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
        if not has_checkpoint(run_dir):
            raise ConfigError(f"run directory {run_dir} already holds a run ({shown}) that "
                              "stopped before its first checkpoint, so there is nothing to "
                              "resume; start over with --overwrite (moves the old contents to "
                              f"{run_dir.name}.old-<time>)")
        raise ConfigError(f"run directory {run_dir} already holds a run ({shown}); continue it "
                          "with --resume, or start over with --overwrite (moves the old contents "
                          f"to {run_dir.name}.old-<time>)")


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir/checkpoints`` holds any ``step_*`` directory (verified or not)."""
    root = run_dir / "checkpoints"
    try:
        return any(re.match(r"^step_\d+$", p.name) and p.is_dir() for p in root.iterdir())
    except OSError:
        return False


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
