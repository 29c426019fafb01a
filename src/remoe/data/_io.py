"""Small file helpers of the data pipeline: hashing, stable hashes, build keys, a source file's
change.
(Atomic writes: :mod:`remoe.fileio`.)"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

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


def stage_key(obj: Any) -> str:
    """A build key: the sha256 of the canonical JSON of what the build depends on."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))
