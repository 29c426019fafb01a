"""``train.portable_kernels``: pinned kernel paths (remoe.machine.kernels), refused in one line
where they cannot be pinned, and a committed fingerprint of a pinned 20-step micro run that
the suite compares on whatever CPU runs it.

The fingerprint is recorded on an AMD EPYC under MKL's ``COMPATIBLE`` branch. Under the first
pin (``MKL_CBWR=AVX2``, which MKL honours on Intel CPUs only) it was recorded on an Intel Xeon
and the AMD EPYC differed from step 1's gradient norm on (docs/RELIABILITY.md); whether a Xeon
gives the same bits under ``COMPATIBLE`` is what this test says on its first run there. To
record it again after a change that moves the numbers on purpose (model, data, trainer):
``REMOE_WRITE_FINGERPRINT=1 OMP_NUM_THREADS=1 python3 -m pytest tests/machine/test_kernels.py -k
fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remoe.errors import ConfigError
from remoe.machine import kernels

FINGERPRINT = Path(__file__).with_name("kernel_fingerprint.json")
KEYS = ("lm_loss", "loss", "sparsity", "lambda", "grad_norm")


def _argv(data_cfg, out: Path, **extra) -> list[str]:
    sets = {"run.out_dir": out, "run.name": "pinned", "model.preset": "micro",
            "data.cache_dir": data_cfg.cache_dir,
            "data.max_bytes_per_domain": data_cfg.max_bytes_per_domain,
            "data.vocab_size": data_cfg.vocab_size, "train.seq_len": 32,
            "train.micro_batch_size": 4, "train.max_steps": 20, "train.warmup_steps": 4,
            "train.eval_every": 0, "train.save_every": 0, "train.log_every": 0,
            "train.num_threads": 1, "train.portable_kernels": "true",
            "analysis.record_masks_every": 0, **extra}
    return (["train", "--no-progress", "--allocator", "default"]
            + [f"--set={k}={v}" for k, v in sets.items()])


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def _torch() -> str:
    import torch

    return f"{torch.__version__} (default kernels {torch.backends.cpu.get_cpu_capability()})"


def test_unpinned_names_what_is_missing():
    assert kernels.unpinned(kernels.PINNED) == {}
    assert kernels.unpinned({"ATEN_CPU_CAPABILITY": "AVX2", "MKL_CBWR": "compatible"}) == {
        "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_refused_in_one_line_once_torch_started(micro_data_cfg, tmp_path, monkeypatch, capsys):
    """In a process that already started torch (a test, a notebook) the pin cannot act: one
    line naming the environment to set; and the thread count must be fixed."""
    import torch  # noqa: F401 - torch has started

    from remoe.cli import main

    for k in kernels.PINNED:
        monkeypatch.delenv(k, raising=False)
    assert main(_argv(micro_data_cfg, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE" in err[0], err
    assert main(_argv(micro_data_cfg, tmp_path, **{"train.num_threads": "null"})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a fixed train.num_threads" in err[0], err
    assert not (tmp_path / "pinned").exists()
    with pytest.raises(ConfigError, match="portable_kernels=2 must be of type bool"):
        from remoe.experiment import load_config

        load_config(None, ["train.portable_kernels=2"])


def _records(path: Path) -> list[dict]:
    from remoe.train.metrics import without_machine_keys

    return without_machine_keys([json.loads(x) for x in path.read_text().splitlines() if x])


def test_pinned_micro_run_matches_the_committed_fingerprint(micro_data_cfg, tmp_path):
    """20 steps under the pin (``remoe train`` sets the environment itself, before torch
    starts): the metrics' hash equals the one committed, on any x86-64 CPU with AVX2 and the
    same torch (its kernels change between versions). Unpinned, the same run differs from it
    (seen on an Intel Xeon and on an AMD EPYC)."""
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINNED}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "remoe.cli", *_argv(micro_data_cfg, tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(tmp_path / "pinned" / "metrics.jsonl")
    digest = hashlib.sha256(json.dumps(recs, sort_keys=True).encode()).hexdigest()
    steps = [{k: r.get(k) for k in ("step", *KEYS)} for r in recs]
    if os.environ.get("REMOE_WRITE_FINGERPRINT") == "1":
        FINGERPRINT.write_text(json.dumps({"sha256": digest, "cpu": _cpu_name(),
                                           "torch": _torch(), "steps": steps}, indent=1) + "\n")
    want = json.loads(FINGERPRINT.read_text())
    if digest == want["sha256"]:
        return
    first = next(((s["step"], k, s[k], w[k]) for s, w in zip(steps, want["steps"])
                  for k in KEYS if s[k] != w[k]), None)
    where = ("at step {}, {}: {!r} here, {!r} there".format(*first) if first else
             "in a metric other than " + ", ".join(KEYS))
    pytest.fail(f"the pinned micro run differs from the fingerprint recorded on {want['cpu']} "
                f"with torch {want['torch']} {where}. This CPU ({_cpu_name()}, torch {_torch()}) "
                "computes other bits under "
                f"{kernels.as_shell(kernels.PINNED)}, so train.portable_kernels does not hold "
                "between the two: report it (docs/RELIABILITY.md); or the model, data or trainer "
                "changed on purpose: record it again (this file's docstring)")


COMPILED_LOSS = """
import torch
import torch.nn.functional as F
from remoe.machine import kernels

def loss(h, w, y):  # an LM head and its cross-entropy, as remoe.model.losses.lm_loss
    return F.cross_entropy(F.linear(h, w).float(), y)

kernels.separate_compile_cache()
g = torch.Generator().manual_seed(0)
h, w = torch.randn(66, 16, generator=g), torch.randn(300, 16, generator=g)
y = torch.randint(0, 300, (66,), generator=g)
eager, compiled = loss(h, w, y), torch.compile(loss)(h, w, y)
print(torch.backends.cpu.get_cpu_capability(), float((compiled - eager).abs() / eager))
"""


CACHE_DIR = """
import torch
from remoe.machine import kernels
print(torch.backends.cpu.get_cpu_capability(), kernels.separate_compile_cache())
"""


def _env_without_pins(tmp_path) -> dict[str, str]:
    drop = (*kernels.PINNED, "TORCHINDUCTOR_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")  # inductor's default dir below it
    return env


def test_each_cpu_kernel_path_has_its_own_compile_cache(tmp_path, monkeypatch):
    """:func:`kernels.separate_compile_cache`: a directory per ATen CPU capability below
    inductor's default one (why: the slow test below); one the user chose is left alone."""
    seen = {}
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        proc = subprocess.run([sys.executable, "-c", CACHE_DIR],
                              env={**_env_without_pins(tmp_path), **extra},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cap, path = proc.stdout.split()
        seen[cap] = Path(path)
    for cap, path in seen.items():
        assert path.name == f"remoe-{cap.lower()}", seen
        assert path.parent.parent == tmp_path and path.parent.name.startswith("torchinductor_")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels.separate_compile_cache() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.slow
def test_compiled_graphs_are_cached_per_cpu_kernel_path(tmp_path):
    """Inductor's disk cache does not key on ATen's CPU capability: a loss compiled under the
    default kernels and loaded under ``ATEN_CPU_CAPABILITY=avx2`` came out 64.3 for 5.96
    (torch 2.13, AMD EPYC). With :func:`kernels.separate_compile_cache` each path compiles its
    own (fails with it turned off: 5.6% off). Slow (two cold compilations, ~45 s): run with
    ``-m slow``."""
    env = _env_without_pins(tmp_path)
    out = []
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):  # the second finds the first's cache
        proc = subprocess.run([sys.executable, "-c", COMPILED_LOSS], env={**env, **extra},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cap, rel = proc.stdout.split()
        out.append(cap)
        assert float(rel) < 1e-5, (extra, cap, rel)  # the eager loss, cache hit or not
    caches = sorted(p.name for p in tmp_path.glob("torchinductor_*/remoe-*"))
    assert caches == sorted({f"remoe-{c.lower()}" for c in out}), caches
