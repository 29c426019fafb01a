"""The data cache's lock: one builder at a time, readers of a read-only cache welcome.

``<cache>/.lock`` is ``flock``'ed exclusively (holding the builder's PID) while the cache is
built or verified; a read-only cache is read under a shared lock, or none when it has no lock
file. Used by :func:`remoe.data.pipeline.prepare_data`.
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
