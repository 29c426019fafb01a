"""remoe.machine.allocator: modes, errors, and that ``retain`` really keeps freed large blocks.

The allocator checks run in a subprocess: mallopt changes the whole process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from remoe.machine import allocator
from remoe.errors import ConfigError

PROBE = r"""
import sys
from remoe.machine import allocator
desc = allocator.configure(sys.argv[1])
import torch

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

base = rss_mb()
x = torch.ones(64 * 2**20)  # 256 MB, far above glibc's largest mmap threshold (32 MB)
held = rss_mb()
del x
print(desc)
print(round(held - base), round(rss_mb() - base))
"""


def test_unknown_mode_is_one_clear_error():
    expected = "allocator: unknown value 'jemalloc'; allowed: auto, default, retain, tcmalloc"
    with pytest.raises(ConfigError, match=expected):
        allocator.configure("jemalloc")


def test_default_mode_changes_nothing():
    assert "default" in allocator.configure("default")


@pytest.mark.skipif(not sys.platform.startswith("linux") or allocator._glibc() is None,
                    reason="glibc only")
@pytest.mark.parametrize("mode", ["default", "retain"])
def test_retain_keeps_freed_large_blocks(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    held, after_free = map(int, out[-1].split())
    assert held >= 250  # the tensor was resident
    if mode == "retain":
        assert out[0].startswith("glibc malloc, retain")
        assert after_free >= 250  # kept for the next step: no munmap, no page faults on reuse
    else:
        assert after_free < 50  # glibc unmapped it at free()


def test_auto_never_restarts_a_process_it_does_not_own():
    assert allocator.resolve("auto", may_reexec=False) in ("default", "tcmalloc")
    if not allocator.tcmalloc_loaded():
        assert allocator.resolve("auto", may_reexec=False) == "default"
        assert "default" in allocator.configure("auto", may_reexec=False)


@pytest.mark.skipif(allocator.tcmalloc_path() is None, reason="libtcmalloc-minimal4 not installed")
def test_auto_restarts_the_command_with_tcmalloc_preloaded():
    code = ("import os, sys; from remoe.machine import allocator; "
            "print(allocator.configure('auto', 'probe')); print(os.environ.get('LD_PRELOAD'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("tcmalloc") and out[1].split(":")[0] == allocator.tcmalloc_path()
    if not allocator.tcmalloc_loaded():
        preload = allocator.child_environment("auto")["LD_PRELOAD"]
        assert preload.split(":")[0] == allocator.tcmalloc_path()
