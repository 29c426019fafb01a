"""``remoe eval RUN`` on a run that is still training.

The checkpoint eval picks is pinned (a private snapshot of hard links) until eval ends, so the
training run pruning it (``train.keep_last=1``, a checkpoint every step) cannot make the load
fail; the results are not written into a run directory another process holds (one line says
so and how to keep them); a finished run gets its eval_results.json under the run's lock."""

import json
import os
import signal
import time

import pytest

import remoe.train.trainer  # noqa: F401 - imported once here, not in the forked child
from remoe.cli import main


@pytest.fixture
def live_run(tmp_path, train_argv, rd):
    run = tmp_path / "live"
    argv = train_argv(tmp_path, "live", **{"train.max_steps": 100000, "train.eval_every": 0,
                                           "train.save_every": 1, "train.keep_last": 1})
    pid = rd.fork_main(argv, tmp_path / "live.log")
    try:
        rd.wait_for(lambda: (run / "checkpoints" / "LATEST").exists(), timeout=600)
        yield run
    finally:
        os.kill(pid, signal.SIGKILL)
        rd.wait_exit(pid)


def _wait_until_pruned(monkeypatch):
    """Between choosing the checkpoint and loading it, wait until the run has pruned it (what
    a slow data or task preparation lets happen on a real machine)."""
    import remoe.eval.cli as ev

    real = ev._run_config
    seen = []

    def slow(model_dir):
        deadline = time.monotonic() + 60
        while model_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(not model_dir.exists())
        return real(model_dir)

    monkeypatch.setattr(ev, "_run_config", slow)
    return seen


def test_eval_of_a_live_run_survives_pruning(live_run, tmp_path, monkeypatch, capsys):
    import tempfile
    from pathlib import Path

    pins = set(Path(tempfile.gettempdir()).glob("remoe-pin-*"))
    pruned = _wait_until_pruned(monkeypatch)
    for i in range(3):
        out = tmp_path / f"ev{i}.json"
        capsys.readouterr()
        code = main(["eval", str(live_run), "--tasks", "none", "--loss-chunks", "1",
                     "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 0, err
        rec = json.loads(out.read_text())["models"][0]
        assert rec["loss"]["loss"] > 0 and "/checkpoints/step_" in rec["model_dir"]
    assert all(pruned) and len(pruned) == 3  # each time its checkpoint was gone before loading
    assert set(Path(tempfile.gettempdir()).glob("remoe-pin-*")) <= pins  # snapshots removed


def test_eval_does_not_write_into_a_live_run(live_run, capsys):
    capsys.readouterr()
    code = main(["eval", str(live_run), "--tasks", "none", "--loss-chunks", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert not (live_run / "eval_results.json").exists()
    line = [x for x in err.splitlines() if "results not written" in x]
    assert len(line) == 1 and "in use by pid" in line[0] and "--out FILE" in line[0], err


def test_eval_of_a_finished_run_writes_under_its_lock(tmp_path, train_argv, capsys):
    assert main(train_argv(tmp_path, "done", **{"train.max_steps": 2,
                                                 "train.eval_every": 0})) == 0
    run = tmp_path / "done"
    assert main(["eval", str(run), "--tasks", "none", "--loss-chunks", "1"]) == 0
    assert json.loads((run / "eval_results.json").read_text())["models"][0]["loss"]
    assert (run / ".lock").read_text() == ""  # taken for the write, released
