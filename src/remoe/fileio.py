"""Writing a file so that no reader ever sees it half written: a temporary sibling, fsync'ed,
renamed over the path (``os.replace``); on an error the temporary file goes and the path is left
as it was. One implementation for every package (the data store, the run's masks, the studies'
state, the GPU check's JSON, the built-in tasks)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator


def new_file_mode() -> int:
    """0o666 less the process umask (the mode ``open()`` gives a new file), read from
    /proc/self/status where it is (changing the umask to read it races other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, ValueError, IndexError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path``; on success fsync and ``os.replace`` it into place.

    On an exception the temporary file is removed and ``path`` is left untouched, so a reader
    never sees a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp makes it 0600: give it what open() would
        with os.fdopen(fd, mode) as f:
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The parsed JSON in ``path``, or None if it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
