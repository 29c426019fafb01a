"""Writing the files of a run without leaving half of one: a full disk reported as such
(:func:`writing`, :class:`DiskFullError`), atomic text writes, strict JSON (NaN/inf -> null),
JSONL read tolerant of a torn last line and appended in whole lines; and the one-line stderr
messages of the run directory code (:func:`say`, :func:`warn`).

A low module: the standard library, :mod:`remoe.errors` and :mod:`remoe.fileio` only. See
:mod:`remoe.rundir`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from remoe import fileio
from remoe.errors import ConfigError

_DISK_FULL_TEXT = ("no space left", "storagefull", "os error 28", "disk quota")


class DiskFullError(ConfigError):
    """The file system filled up while writing part of a run (nothing half-written is kept)."""


def say(msg: str) -> None:
    """One line on stderr about what the run directory code did."""
    print(f"remoe train: {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"remoe train: warning: {msg}", file=sys.stderr, flush=True)


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


# ----------------------------------------------------------------------------- durability
# A rename is atomic but not durable: after a power loss the new name can point at a file whose
# data never reached the disk. What resume relies on is made durable in this order: the files'
# data (fsync each), then the directory entry of the rename (fsync the parent directory).

def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename into it, a new file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # a file system without directory fds: nothing more can be done
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (deepest first)."""
    dirs = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                fsync_file(p)
        dirs += [Path(dirpath) / d for d in dirnames]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`remoe.fileio.atomic_write_text`, durable on return (the directory is fsync'ed
    after the rename), a full disk reported as :class:`DiskFullError`."""
    with writing(path):
        fileio.atomic_write_text(path, text)
        fsync_dir(path.parent)


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

    def sync(self) -> None:
        """Make every line written so far durable (before a checkpoint that counts on them)."""
        if self.fd is not None:
            with writing(self.path):
                os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
