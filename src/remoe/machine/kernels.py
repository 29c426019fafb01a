"""Pinned CPU kernel paths (``train.portable_kernels: true``): the same config and seed give the
same bits on any x86-64 CPU with AVX2, Intel or AMD.

By default ATen picks its vectorised kernels for the CPU it finds (AVX-512 on an Intel Xeon,
AVX2 on an AMD EPYC), and so do MKL (sgemm) and oneDNN; their float32 results differ in the low
bits, and a training trajectory amplifies them (docs/RELIABILITY.md). The pin removes that
choice: ATen and oneDNN run their AVX2 code, and MKL its conditional numerical reproducibility
branch ``COMPATIBLE`` (SSE2 without the approximate rcpps/rsqrtps). ``COMPATIBLE`` because it is
the one fixed MKL branch that non-Intel CPUs honour: ``MKL_CBWR=AVX2`` is Intel-only, and an AMD
CPU silently runs MKL's ``AUTO`` branch under it (``MKL_VERBOSE`` prints ``CNR:AUTO``), which
differed from an Intel Xeon in the last bit of step 1's gradient norm. The variables are read
once, when torch starts: ``remoe train`` sets them before it imports torch (or restarts itself
with them); a process that already started torch is refused in one line naming the environment
to set. A fixed ``train.num_threads`` is required too, since the default (all usable cores)
differs between machines.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from remoe.errors import ConfigError

#: the environment that pins ATen and oneDNN to their AVX2 code and MKL to its vendor-neutral
#: reproducible branch
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def unpinned(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of :data:`PINNED` that ``env`` does not set to their pinned value."""
    return {k: v for k, v in PINNED.items() if env.get(k, "").upper() != v.upper()}


def as_shell(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


def pin(owns_process: bool, field: str = "train.portable_kernels") -> None:
    """Pin the kernel paths of this process: set them while torch has not started; otherwise
    restart the process with them when it is ours (the ``remoe`` command), else refuse."""
    todo = unpinned(os.environ)
    if not todo:
        return
    if "torch" not in sys.modules:
        os.environ.update(todo)  # read by torch, MKL and oneDNN when they start
        return
    if owns_process:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **todo})
    raise ConfigError(f"{field}=true: torch started before the kernel paths were pinned; set "
                      f"{as_shell(todo)} before starting Python (the remoe command does it)")


def check_cpu(field: str = "train.portable_kernels") -> str:
    """The capability ATen runs under the pin ("AVX2"); a CPU without AVX2 is refused."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if cap != "AVX2":
        raise ConfigError(f"{field}=true needs an x86-64 CPU with AVX2; ATen runs {cap} "
                          "kernels here")
    return cap


def separate_compile_cache() -> str | None:
    """Give ``torch.compile``'s on-disk cache (inductor's ``TORCHINDUCTOR_CACHE_DIR``) one
    directory per ATen CPU capability, below inductor's default directory; the directory set,
    or None where the user chose one (left as it is). Inductor does not key its cache on the
    capability: a graph compiled under one (AVX-512) and loaded under another
    (``ATEN_CPU_CAPABILITY=avx2``: the pin above, or the suite's second kernel path) computed
    wrong numbers on torch 2.13 (docs/RELIABILITY.md)."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != base and os.path.dirname(
            os.path.abspath(chosen)) != base:
        return None
    path = os.path.join(base, f"remoe-{torch.backends.cpu.get_cpu_capability().lower()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by inductor at every compilation
    return path


def configure(portable: bool, num_threads, owns_process: bool) -> None:
    """``train.portable_kernels``: require a fixed thread count, pin the kernel paths and check
    the CPU, before any torch work; nothing when ``portable`` is false."""
    if not portable:
        return
    if not isinstance(num_threads, int):
        raise ConfigError(f"train.portable_kernels=true needs a fixed train.num_threads (e.g. 1); "
                          f"{num_threads!r} differs between machines")
    pin(owns_process)
    check_cpu()
