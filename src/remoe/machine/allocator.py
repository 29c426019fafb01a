"""Host (CPU) memory allocator settings for the ``remoe`` commands.

Why: every training step frees and re-allocates the same large buffers (weight gradients,
logits, saved activations). glibc serves blocks above its mmap threshold (at most 32 MiB) with
a fresh ``mmap`` and returns them with ``munmap`` on free, so each step page-faults and zeroes
them again. At E=128 (T=4096, d=256) the 400 MB of expert weight gradients cost more than the
expert matmuls themselves (docs/PERFORMANCE.md). Modes:

* ``auto`` (the CLI default): ``tcmalloc`` when ``libtcmalloc_minimal`` is installed (the
  install script installs it) and the command owns its process, else ``default``;
* ``default``: leave the allocator alone;
* ``tcmalloc``: re-execute the command with ``libtcmalloc_minimal`` preloaded (it keeps freed
  large spans for reuse and returns memory to the OS gradually), as PyTorch's CPU tuning guide
  recommends; needs ``apt-get install libtcmalloc-minimal4``;
* ``retain`` (opt-in, glibc, no restart): ``mallopt`` so large blocks come from the heap and
  freed memory is never trimmed: the next step's gradients reuse the same pages. Caveat: every
  block then lives in one heap, and allocation patterns that interleave many large short-lived
  blocks with small long-lived ones fragment it without bound (what was measured:
  docs/PERFORMANCE.md, "Allocator").

Only the command-line entry points call :func:`configure`; importing ``remoe`` never changes
the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from remoe.errors import ConfigError

MODES = ("auto", "default", "retain", "tcmalloc")

# glibc <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def tcmalloc_path() -> str | None:
    return next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)


def tcmalloc_loaded() -> bool:
    return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def retain_freed_memory() -> bool:
    """glibc: serve large blocks from the heap and never trim it. False where unsupported."""
    libc = _glibc()
    if libc is None or tcmalloc_loaded():
        return False
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return bool(ok)


def _preload_value() -> str:
    """``LD_PRELOAD`` with tcmalloc first, keeping whatever the user preloads already."""
    rest = os.environ.get("LD_PRELOAD", "")
    return f"{tcmalloc_path()}:{rest}" if rest else tcmalloc_path()


def reexec_with_tcmalloc(command: str = "remoe") -> None:
    """Replace this process by the same command with tcmalloc preloaded (Linux only)."""
    check_mode("tcmalloc", command)
    env = dict(os.environ, LD_PRELOAD=_preload_value())
    # orig_argv keeps the interpreter's own options (``python -m remoe.cli ...``)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def resolve(mode: str, may_reexec: bool = True) -> str:
    """The concrete mode ``mode`` stands for (``auto`` -> ``tcmalloc`` or ``default``)."""
    check_mode(mode)
    if mode != "auto":
        return mode
    if tcmalloc_loaded() or (may_reexec and tcmalloc_path() is not None):
        return "tcmalloc"
    return "default"


def configure(mode: str, command: str = "remoe", may_reexec: bool = True) -> str:
    """Apply ``mode`` (one of :data:`MODES`) to this process; returns :func:`describe`.

    ``tcmalloc`` re-executes the command with the library preloaded unless it already is;
    ``auto`` does so only when ``may_reexec`` (the command owns its process: not when a test or
    notebook calls the CLI's ``main([...])``); ``retain`` falls back to the default where glibc
    is absent."""
    check_mode(mode, command)
    concrete = resolve(mode, may_reexec)
    if concrete == "tcmalloc" and not tcmalloc_loaded():
        reexec_with_tcmalloc(command)
    if concrete == "retain":
        retain_freed_memory()
    return describe(concrete)


def check_mode(mode: str, command: str = "remoe") -> None:
    """One-line :class:`ConfigError` for an unknown mode or a missing tcmalloc library."""
    if mode not in MODES:
        raise ConfigError(f"allocator: unknown value {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "tcmalloc" and not tcmalloc_loaded() and tcmalloc_path() is None:
        raise ConfigError(f"{command}: allocator=tcmalloc needs libtcmalloc_minimal.so.4 "
                          "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4); "
                          f"allowed: {', '.join(MODES)}")


def child_environment(mode: str) -> dict[str, str]:
    """Environment variables a fresh child process needs to run ``mode`` (tcmalloc: LD_PRELOAD)."""
    if resolve(mode) == "tcmalloc" and not tcmalloc_loaded():
        return {"LD_PRELOAD": _preload_value()}
    return {}


def describe(mode: str) -> str:
    """A one-line description of the allocator a process configured with ``mode`` runs."""
    concrete = resolve(mode)
    if tcmalloc_loaded() or concrete == "tcmalloc":
        return f"tcmalloc ({os.environ.get('LD_PRELOAD') or tcmalloc_path()})"
    if concrete == "retain" and _glibc() is not None:
        return "glibc malloc, retain (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1)"
    return "system malloc, default"
