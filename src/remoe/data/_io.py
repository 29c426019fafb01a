"""Small file helpers shared by the data pipeline: atomic writes, hashing, stable hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

_CHUNK = 1 << 22  # 4 MiB reads when hashing files


def stable_hash(*parts: str | bytes, digest_size: int = 8) -> bytes:
    """A blake2b digest of ``parts`` (independent of PYTHONHASHSEED and platform).

    Parts are length-prefixed so ``("ab", "c")`` and ``("a", "bc")`` differ.
    """
    h = hashlib.blake2b(digest_size=digest_size)
    for p in parts:
        b = p.encode("utf-8") if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def stable_unit(*parts: str | bytes) -> float:
    """Map ``parts`` to a float in [0, 1) via :func:`stable_hash` (53 bits of precision)."""
    v = int.from_bytes(stable_hash(*parts, digest_size=8), "big") >> 11
    return v / float(1 << 53)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            buf = f.read(_CHUNK)
            if not buf:
                break
            h.update(buf)
    return h.hexdigest()


def file_change(entry: dict[str, Any], *, full: bool) -> str | None:
    """None when the file of ``entry`` is as recorded (size and modification time; its sha256
    too with ``full``), else why not, in words naming it."""
    path = Path(entry["path"])
    what = f"source file {path}{' (read in place)' if 'dtype' in entry else ''}"
    if not path.is_file():
        return f"{what} is missing"
    st = path.stat()
    if st.st_size != entry["bytes"] or st.st_mtime_ns != entry["mtime_ns"]:
        return (f"{what} changed since the store was built ({st.st_size} bytes, recorded "
                f"{entry['bytes']}; or its modification time)")
    if full and sha256_file(path) != entry["sha256"]:
        return f"{what} does not match its sha256: its content changed since the store was built"
    return None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
