"""Ctrl-C (SIGINT) during ``remoe train``: the first finishes the step, checkpoints it, prints
the resume command and exits 130; ``--resume`` then finishes the run bit for bit as an
uninterrupted one. A second SIGINT stops at once. The interrupted trainings are real processes
(forked); the signal is sent from inside the chosen step, so the stop is deterministic."""

import os
import signal

import pytest

from remoe import rundir
from remoe.cli import main


def _sigint_in_step(step, times=1, sig=signal.SIGINT):
    """Child: ``sig`` (SIGINT by default) to itself while optimizer step ``step`` (1-based)
    runs, ``times`` times."""
    def before():
        from remoe.train.trainer import Trainer

        real = Trainer.train_step

        def train_step(self):
            rec = real(self)
            if rec["step"] == step:
                for _ in range(times):
                    os.kill(os.getpid(), sig)
            return rec

        Trainer.train_step = train_step
    return before


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, train_argv):
    out = tmp_path_factory.mktemp("ctrl_c_ref")
    assert main(train_argv(out, "ref")) == 0
    return out / "ref"


@pytest.mark.parametrize("step", [3, 4])  # 3: between checkpoints; 4: a checkpoint step
def test_first_sigint_checkpoints_the_step_and_resume_is_bit_exact(
        step, tmp_path, train_argv, rd, uninterrupted):
    argv = train_argv(tmp_path, "r")
    log = tmp_path / "log"
    pid = rd.fork_main(argv, log, before=_sigint_in_step(step))
    assert rd.wait_exit(pid) == 130
    text = log.read_text()
    assert f"interrupted after step {step}; checkpoint" in text
    resume = next(x for x in text.splitlines() if x.startswith("resume with: "))[13:]
    assert resume.startswith("remoe train --set") and resume.endswith(" --resume")
    run = tmp_path / "r"
    assert rundir.read_latest(run / "checkpoints")[0] == f"step_{step:07d}"
    assert len(rd.read_jsonl(run / "metrics.jsonl")) == step
    assert not (run / "final").exists()

    assert main(argv + ["--resume"]) == 0
    assert rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl")) == rd.strip_timing(
        rd.read_jsonl(uninterrupted / "metrics.jsonl"))
    assert rd.read_jsonl(run / "eval.jsonl") == rd.read_jsonl(uninterrupted / "eval.jsonl")
    assert rd.same_weights(rd.weights(run), rd.weights(uninterrupted))


def test_sigterm_checkpoints_the_step_says_so_and_exits_143(tmp_path, train_argv, rd):
    """A scheduler's pre-emption (SIGTERM) keeps the work as Ctrl-C does, with its own status."""
    log = tmp_path / "log"
    pid = rd.fork_main(train_argv(tmp_path, "r"), log,
                       before=_sigint_in_step(3, sig=signal.SIGTERM))
    assert rd.wait_exit(pid) == 143
    text = log.read_text()
    assert "remoe train: SIGTERM: finishing this step, then a checkpoint" in text
    assert "interrupted after step 3; checkpoint" in text and "resume with: " in text
    assert rundir.read_latest(tmp_path / "r" / "checkpoints")[0] == "step_0000003"


def test_second_sigint_stops_at_once(tmp_path, train_argv, rd):
    log = tmp_path / "log"
    pid = rd.fork_main(train_argv(tmp_path, "r"), log, before=_sigint_in_step(3, times=2))
    assert rd.wait_exit(pid) == 130
    text = log.read_text()
    assert "remoe train: interrupted" in text and "resume with" not in text
    # no checkpoint of step 3: the newest is the periodic one of step 2
    assert rundir.read_latest(tmp_path / "r" / "checkpoints")[0] == "step_0000002"


def test_resume_command_is_the_users_own_with_resume():
    import argparse

    from remoe.train.cli import resume_command

    args = argparse.Namespace(config="configs/my run.yaml", overrides=["train.max_steps=10"],
                              no_progress=True, allocator="default")
    assert resume_command(args) == ("remoe train 'configs/my run.yaml' --set "
                                    "train.max_steps=10 --no-progress --allocator default "
                                    "--resume")
