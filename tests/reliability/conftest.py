"""Fixtures of the run-directory reliability tests (tests/reliability/test_rundir_*.py), and
the small corpora and data configs of the data ones (test_data_*.py import them)."""

import json
import os
import signal
import sys
import time
import traceback

from pathlib import Path

import pytest

from remoe.data import DataConfig, prepare_data
from remoe.errors import ConfigError

WORDS = "apple banana cherry delta echo foxtrot golf hotel india juliet kilo lima".split()


def doc_text(i: int, n_words: int = 150) -> str:
    """Document ``i``: a title line and ``n_words`` words."""
    return f"document {i}\n" + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)]
                                         for j in range(n_words)) + "\n"


def txt_corpus(root: Path, domains: tuple[str, ...] = ("alpha", "beta"), docs: int = 6,
               n_words: int = 150) -> Path:
    """``root/<domain>/doc_NN.txt``: ``docs`` documents per domain."""
    for dom in domains:
        (root / dom).mkdir(parents=True, exist_ok=True)
        for i in range(docs):
            (root / dom / f"doc_{i:02d}.txt").write_text(doc_text(i + 100 * len(dom), n_words))
    return root


def data_cfg(tmp_path: Path, *sources: Path | str, **kw) -> DataConfig:
    """A small DataConfig over ``sources`` with its cache under ``tmp_path``."""
    base = dict(sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"),
                vocab_size=300, val_fraction=0.2, test_fraction=0.1)
    base.update(kw)
    return DataConfig(**base)


def one_line_error(cfg: DataConfig) -> str:
    """The ConfigError ``prepare_data(cfg)`` raises, checked to be one line."""
    with pytest.raises(ConfigError) as info:
        prepare_data(cfg, progress=False)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture(scope="session")
def rundir_data_cfg(micro_data_cfg):
    """The session's micro corpus (tests/conftest.py)."""
    return micro_data_cfg


@pytest.fixture(scope="session")
def train_argv(rundir_data_cfg):
    """``remoe train`` arguments for a micro run of 6 steps (checkpoints at 2, 4, 6)."""
    def make(out_dir, name, *flags, **extra):
        d = rundir_data_cfg
        sets = {"run.out_dir": str(out_dir), "run.name": name, "model.preset": "micro",
                "data.cache_dir": d.cache_dir, "data.max_bytes_per_domain": d.max_bytes_per_domain,
                "data.vocab_size": d.vocab_size, "train.seq_len": 32,
                "train.micro_batch_size": 4, "train.max_steps": 6, "train.warmup_steps": 2,
                "train.eval_every": 3, "train.eval_chunks_per_domain": 1, "train.save_every": 2,
                "train.keep_last": 3, "train.log_every": 0, "train.num_threads": 1,
                "analysis.record_masks_every": 0}
        sets.update(extra)
        return (["train", "--no-progress", "--allocator", "default", *flags]
                + [f"--set={k}={v}" for k, v in sets.items()])
    return make


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def strip_timing(records):
    from remoe.train.metrics import without_machine_keys

    return without_machine_keys(records)


def weights(run):
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def same_weights(a, b):
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fork_main(argv, log_path, before=None):
    """Run ``remoe.cli.main(argv)`` in a forked child (a real process, sharing the imports
    already made here); its stdout/stderr go to ``log_path``. ``before`` runs in the child
    first (e.g. to make it die at a chosen moment). Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 99
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
        # Ctrl-C as in a terminal: a suite started in the background inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if before is not None:
            before()
        from remoe.cli import main

        code = main(argv)
    except BaseException:  # noqa: BLE001 - the child must never return into pytest
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def wait_exit(pid, timeout=300.0):
    """The child's exit code (negative: killed by that signal)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} did not finish in {timeout} s")


def wait_for(cond, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="session")
def rd():
    """The helpers above (test modules cannot import this conftest under importlib mode)."""
    import types

    return types.SimpleNamespace(read_jsonl=read_jsonl, strip_timing=strip_timing,
                                 weights=weights, same_weights=same_weights, fork_main=fork_main,
                                 wait_exit=wait_exit, wait_for=wait_for)
