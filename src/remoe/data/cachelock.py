"""The data cache's lock: one builder at a time, readers of a read-only cache welcome; and
the readers' registry: a cache a running process reads is never changed under it.

``<cache>/.lock`` is ``flock``'ed exclusively (holding the builder's PID) while the cache is
built or verified; a read-only cache is read under a shared lock, or none when it has no lock
file. ``<cache>/.readers/<pid>`` is held (shared) by every process whose prepared data is in
use (:func:`register_reader`); a build that would change a file refuses while another
process holds one (:func:`live_readers`). Used by :func:`remoe.data.pipeline.prepare_data`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Iterator

log = logging.getLogger("remoe.data")

LOCK_FILE = ".lock"
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _lock_holder(fd: int) -> str:
    """The PID the lock holder wrote into the lock file ("?" if none yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "?"


# ----------------------------------------------------------------------------- readers
# A process reading a cache (a training run: its batches come from the token arrays for hours)
# holds a shared flock on <cache>/.readers/<pid> as long as its DataBundle lives. A build that
# would change the cache first tries each other process's file exclusively: a held one means a
# live reader and the build is refused (one line naming the PID); a free one is a dead
# reader's, removed. The files are created and checked under the cache's exclusive lock.

READERS_DIR = ".readers"


def register_reader(cache: Path) -> int | None:
    """Hold a shared reader lock on ``cache`` (call under :func:`locked`); returns the fd to
    close when done reading (None: a read-only cache, which cannot change under its reader)."""
    try:
        d = cache / READERS_DIR
        d.mkdir(exist_ok=True)
        fd = os.open(d / str(os.getpid()), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in NOT_WRITABLE:
            return None
        raise
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def release_reader(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def live_readers(cache: Path) -> list[str]:
    """PIDs of other processes reading ``cache`` now (call under :func:`locked`); the files of
    readers that died are removed."""
    d = cache / READERS_DIR
    if not d.is_dir():
        return []
    live = []
    for p in sorted(d.iterdir()):
        if p.name == str(os.getpid()):
            continue  # this process's own bundles: it knows what it rebuilds
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(p.name)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        finally:
            os.close(fd)
    return live


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[bool]:
    """Hold the cache's lock while building or verifying; yields whether the cache is writable.

    A writable cache is locked exclusively and the holder's PID written into ``.lock``; a
    process that has to wait says so at once, naming that PID. A read-only cache (read-only
    file system or no write permission) is only read: a shared lock on an existing ``.lock``
    opened read-only, or no lock at all when there is none.
    """
    path = cache / LOCK_FILE
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+b")
        writable = True
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise
        writable = False
        try:
            fh = open(path, "rb")
        except OSError:
            fh = None
    if fh is None:
        log.info("data cache %s is read-only and has no lock file: reading it unlocked", cache)
        yield False
        return
    with fh:
        mode = fcntl.LOCK_EX if writable else fcntl.LOCK_SH
        try:
            fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for the lock held by PID %s on %s", _lock_holder(fh.fileno()),
                        path)
            fcntl.flock(fh.fileno(), mode)
        try:
            if writable:
                fh.truncate(0)
                fh.write(f"{os.getpid()}\n".encode("ascii"))
                fh.flush()
            yield writable
        finally:
            if writable:
                with contextlib.suppress(OSError):
                    fh.truncate(0)
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
