"""What a build that died leaves behind, and how it goes.

Every file of the store is written under a temporary name (``.NAME.<random>.tmp``, or
``.NAME.tmp`` for the index arrays) and renamed into place, so a kill, a full disk or an error
can leave only such names, the deduplication's spill directory (``<key16>/dedup/``) and build
directories being discarded (``.discard-*``). :func:`sweep` removes them all; a build calls it
under the cache's lock before it writes (no other writer exists then), and after a failed
unit. :func:`discard` takes a whole build directory out of use in one rename before deleting
it, so no reader or later build ever sees part of it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DISCARD_PREFIX = ".discard-"
SPILL_DIR = "dedup"


def is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def sweep(store: Path, *, spill: bool = True) -> int:
    """Remove the temporary files under ``store`` (and, with ``spill``, the build directories'
    ``dedup/`` spill runs and half-discarded directories); returns how many were removed."""
    if not store.is_dir():
        return 0
    n = 0
    for entry in list(store.iterdir()):
        if entry.is_dir() and entry.name.startswith(DISCARD_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            n += 1
        elif spill and entry.is_dir() and (entry / SPILL_DIR).is_dir():
            shutil.rmtree(entry / SPILL_DIR, ignore_errors=True)
            n += 1
    for dirpath, _, filenames in os.walk(store):
        for fn in filenames:
            if is_temporary(fn):
                try:
                    os.unlink(os.path.join(dirpath, fn))
                    n += 1
                except FileNotFoundError:
                    pass
    return n


def discard(root: Path) -> None:
    """Take the build directory ``root`` out of use (one rename), then delete it."""
    if not root.exists():
        return
    gone = root.with_name(f"{DISCARD_PREFIX}{root.name}-{os.getpid()}")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(root, gone)
    shutil.rmtree(gone, ignore_errors=True)
