"""A run's thread count is fixed when it starts, recorded, and reused on resume.

What holds on every x86 CPU, and what these tests check: at one thread count the same config
and seed give the same bits; a resume uses the count the run recorded (not the resuming
process's default) and continues bit for bit; the default never times thread counts (the
tuner is ``train.num_threads: auto`` only). Whether 1 and 2 threads give the same bits depends
on the CPU's MKL kernels (equal on AMD EPYC with AVX2, different on Intel Xeon with AVX-512):
no test asserts it.
"""

import shutil

import pytest
import torch

from remoe.cli import main


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_fused_chunking_does_not_follow_the_thread_count(restore_threads):
    """The chunks decide which experts share a padded product (and so the bits of a step)."""
    from remoe.model.dispatch import fused_rows

    torch.set_num_threads(1)
    one = fused_rows(256, 1024)
    torch.set_num_threads(2)
    assert fused_rows(256, 1024) == one


SMALL = {"model.hidden_size": 256, "train.max_steps": 4, "train.save_every": 2,
         "train.eval_every": 2, "train.keep_last": 3, "train.num_threads": "null"}


@pytest.fixture
def cores(monkeypatch):
    """``cores(n)``: the process's usable cores are ``n`` (what the default count follows);
    the timing tuner must not be built."""
    import remoe.machine.threads as threads

    def no_tuner(*a, **k):
        raise AssertionError("the timing tuner ran under train.num_threads: null")

    monkeypatch.setattr("remoe.train.runtime.ThreadTuner", no_tuner)

    def set_cores(n):
        monkeypatch.setattr(threads, "usable_cores", lambda local_world_size=1: n)
    return set_cores


def _state(run, step):
    from remoe import rundir

    return rundir.load_state(run / "checkpoints" / f"step_{step:07d}")


def test_same_thread_count_same_bits_and_the_default_is_all_usable_cores(
        tmp_path, train_argv, rd, restore_threads, cores):
    cores(2)
    assert main(train_argv(tmp_path, "a", **SMALL)) == 0
    assert main(train_argv(tmp_path, "b", **SMALL)) == 0
    a = rd.read_jsonl(tmp_path / "a" / "metrics.jsonl")
    b = rd.read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["threads"] for r in a] == [2] * 4  # never timed, never another count
    assert _state(tmp_path / "a", 4)["num_threads"] == 2  # recorded in the checkpoint
    assert len(a) == 4 and rd.strip_timing(a) == rd.strip_timing(b)
    assert rd.read_jsonl(tmp_path / "a" / "eval.jsonl") == rd.read_jsonl(
        tmp_path / "b" / "eval.jsonl")
    assert rd.same_weights(rd.weights(tmp_path / "a"), rd.weights(tmp_path / "b"))


@pytest.mark.parametrize("start, resume_default", [(2, 1), (1, 2)])
def test_resume_reuses_the_recorded_count_and_is_bit_exact(
        tmp_path, train_argv, rd, restore_threads, cores, capsys, start, resume_default):
    cores(start)
    assert main(train_argv(tmp_path, "full", **SMALL)) == 0
    shutil.copytree(tmp_path / "full", tmp_path / "r")
    ckpts = tmp_path / "r" / "checkpoints"
    shutil.rmtree(ckpts / "step_0000004")
    (ckpts / "LATEST").write_text("step_0000002")
    cores(resume_default)  # the resuming process would default to another count
    capsys.readouterr()
    assert main(train_argv(tmp_path, "r", "--resume", **SMALL)) == 0
    assert f"--resume: {start} threads, as the run recorded" in capsys.readouterr().err
    full = rd.read_jsonl(tmp_path / "full" / "metrics.jsonl")
    resumed = rd.read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert [r["threads"] for r in resumed] == [start] * 4
    assert rd.strip_timing(resumed) == rd.strip_timing(full)
    assert rd.same_weights(rd.weights(tmp_path / "full"), rd.weights(tmp_path / "r"))


def test_auto_is_the_timing_tuner_and_bad_values_are_one_line(tmp_path, train_argv, capsys):
    from remoe.experiment import load_config
    from remoe.train.runtime import setup_runtime

    cfg = load_config(None, ["train.num_threads=auto"])
    before = torch.get_num_threads()
    try:
        rt = setup_runtime(cfg.train)
    finally:
        torch.set_num_threads(before)
    assert rt.threads is not None and rt.num_threads is None
    for bad in ("fast", "0", "true"):
        assert main(train_argv(tmp_path, "x", **{"train.num_threads": bad})) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "train.num_threads=" in err[0]
    assert not (tmp_path / "x").exists()


def test_the_load_hint_names_the_fix_and_never_changes_the_count(monkeypatch, restore_threads,
                                                                  capsys):
    import remoe.machine.threads as threads

    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.9, 1.9, 1.9))
    assert threads.fix_threads("remoe eval", 2) == 2 and torch.get_num_threads() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OMP_NUM_THREADS=1" in err[0] and "load average 1.9" in err[0]
    assert threads.fix_threads("remoe eval", 1) == 1  # one thread: nothing to suggest
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert threads.fix_threads("remoe eval", 2) == 2
    assert capsys.readouterr().err == ""
