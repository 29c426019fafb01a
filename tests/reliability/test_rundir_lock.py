"""One writer per run directory, and no fresh run over an old one.

Two trainings into one directory at once: the second gets a one-line error naming the first's
PID; after the first is killed with -9, its stale lock is taken over with a warning. A run
without ``--resume`` refuses a directory that holds a run; ``--overwrite`` moves the old
contents aside and says where."""

import os
import signal

from remoe.cli import main


def test_two_writers_then_stale_lock_then_overwrite(tmp_path, train_argv, rd, capsys):
    run = tmp_path / "w"
    long = train_argv(tmp_path, "w", **{"train.max_steps": 100000, "train.eval_every": 0,
                                        "train.save_every": 0})
    pid = rd.fork_main(long, tmp_path / "first.log")
    try:
        rd.wait_for(lambda: (run / "metrics.jsonl").exists()
                    and (run / "metrics.jsonl").stat().st_size > 0)
        short = {"train.max_steps": 2, "train.eval_every": 0}
        for flags in ((), ("--resume",), ("--overwrite",)):
            capsys.readouterr()
            assert main(train_argv(tmp_path, "w", *flags, **short)) == 2, flags
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"is in use by pid {pid}" in err[0], (flags, err)
        assert rd.read_jsonl(run / "metrics.jsonl")  # the first writer's run is untouched
    finally:
        os.kill(pid, signal.SIGKILL)
        assert rd.wait_exit(pid) == -signal.SIGKILL
    killed_steps = len(rd.read_jsonl(run / "metrics.jsonl"))

    capsys.readouterr()
    assert main(train_argv(tmp_path, "w", **short)) == 2  # a fresh run refuses the old one
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--overwrite" in err[0]

    assert main(train_argv(tmp_path, "w", "--overwrite", **short)) == 0
    err = capsys.readouterr().err
    assert f"took over the stale lock of {run} left by pid {pid} (no longer running)" in err
    archived = [p for p in tmp_path.iterdir() if p.name.startswith("w.old-")]
    assert len(archived) == 1
    assert f"--overwrite: moved the old contents of {run} to {archived[0]}" in err
    assert len(rd.read_jsonl(archived[0] / "metrics.jsonl")) == killed_steps
    assert [r["step"] for r in rd.read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert (run / ".lock").read_text() == ""  # released at the end


def test_fresh_run_into_a_copied_run_refuses(tmp_path, train_argv, rd, capsys):
    """The issue's case: `cp -a runs/U runs/R` then a fresh run named R used to prune the old
    run's checkpoints into its own and leave LATEST pointing to a deleted directory."""
    short = {"train.max_steps": 4, "train.eval_every": 0}
    assert main(train_argv(tmp_path, "U", **short)) == 0
    import shutil

    shutil.copytree(tmp_path / "U", tmp_path / "R")
    before = sorted(p.relative_to(tmp_path / "R") for p in (tmp_path / "R").rglob("*"))
    capsys.readouterr()
    assert main(train_argv(tmp_path, "R", **{"train.max_steps": 2, "train.eval_every": 0})) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path / "R") for p in (tmp_path / "R").rglob("*")) == before
    assert main(train_argv(tmp_path, "R", "--overwrite", "--resume")) == 2
    assert "exclude each other" in capsys.readouterr().err
