"""kill -9 at chosen and at random moments (inside a checkpoint write, inside a metrics line,
anywhere after the first checkpoint): ``--resume`` then finishes the run bit for bit as an
uninterrupted one. The killed trainings are real processes (forked from the test process, so
they share its imports instead of paying ~10 s of CPU to import torch again)."""

import os
import random
import signal
import time
from pathlib import Path

import pytest

from remoe import rundir
from remoe.cli import main


def _die_in_second_trainer_state_write():
    """Child: the 2nd torch.save (step 4's trainer_state.pt) leaves half a file, then kill -9."""
    import torch

    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        calls.append(f)
        if len(calls) == 2:
            p = Path(f)
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def _die_in_manifest_write():
    """Child: step 4's checksums.json is half written when the process is killed."""
    real = rundir.write_manifest

    def write_manifest(ckpt_dir):
        real(ckpt_dir)
        if ckpt_dir.name.startswith(".step_0000004"):
            m = ckpt_dir / rundir.MANIFEST
            m.write_bytes(m.read_bytes()[:40])
            os.kill(os.getpid(), signal.SIGKILL)

    rundir.write_manifest = write_manifest


def _die_in_metrics_line():
    """Child: the metrics line of step 5 is torn in the middle by kill -9."""
    real = rundir.JsonlAppender.write

    def write(self, record):
        if self.path.name == "metrics.jsonl" and record.get("step") == 5:
            data = (rundir.dumps_json(record) + "\n").encode()
            os.write(self.fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, record)

    rundir.JsonlAppender.write = write


MOMENTS = {"trainer_state": _die_in_second_trainer_state_write, "manifest": _die_in_manifest_write,
           "metrics_line": _die_in_metrics_line, "random_1": 1, "random_2": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train_argv):
    """An uninterrupted run of the same config."""
    out = tmp_path_factory.mktemp("kill_ref")
    assert main(train_argv(out, "ref")) == 0
    return out / "ref"


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_9_then_resume_is_bit_exact(moment, reference, train_argv, rd, tmp_path, capsys):
    run = tmp_path / "cut"
    argv = train_argv(tmp_path, "cut")
    how = MOMENTS[moment]
    pid = rd.fork_main(argv, tmp_path / "child.log", before=how if callable(how) else None)
    if not callable(how):  # a random moment after the first checkpoint
        rd.wait_for(lambda: (run / "checkpoints" / "LATEST").exists())
        time.sleep(random.Random(how).uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
    code = rd.wait_exit(pid)
    log = (tmp_path / "child.log").read_text()
    # a random kill may land after the run's end on a fast machine: then this is a resume of a
    # finished run, which must give the same result too
    assert code == -signal.SIGKILL or (not callable(how) and code == 0), (code, log[-2000:])
    capsys.readouterr()

    assert main(argv + ["--resume"]) == 0
    err = capsys.readouterr().err
    if moment in ("trainer_state", "manifest"):
        assert "removed 1 leftover(s) of interrupted writes" in err and ".step_0000004.tmp" in err
    if moment == "metrics_line":
        assert "dropped 1 unreadable line(s)" in err and "metrics.jsonl" in err

    ref = reference
    assert rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl")) == \
        rd.strip_timing(rd.read_jsonl(ref / "metrics.jsonl"))
    assert rd.read_jsonl(run / "eval.jsonl") == rd.read_jsonl(ref / "eval.jsonl")
    assert rd.same_weights(rd.weights(run), rd.weights(ref))
    # nothing half-written is left, every checkpoint verifies, the lock is released
    assert not [p for p in run.rglob("*") if rundir.is_temporary(p.name)]
    ckpts = rundir.checkpoint_dirs(run / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000006", "step_0000004", "step_0000002"]
    assert all(rundir.verify_manifest(c) is None for c in ckpts)
    assert (run / ".lock").read_text() == ""


def test_kill_9_of_a_real_remoe_train_process(reference, train_argv, rd, tmp_path, capsys):
    """The same through the real entry point (`python -m remoe.cli train` in a subprocess,
    ~10 s of CPU for its imports), killed at a random moment after its first checkpoint."""
    import subprocess
    import sys

    run = tmp_path / "sub"
    argv = train_argv(tmp_path, "sub")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "sub.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "remoe.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            rd.wait_for(lambda: (run / "checkpoints" / "LATEST").exists()
                        or proc.poll() is not None, timeout=300)
            time.sleep(random.Random(3).uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
        finally:
            code = proc.wait()
    assert code in (-signal.SIGKILL, 0), (tmp_path / "sub.log").read_text()[-2000:]
    assert (run / ".lock").read_text().strip() in ("", str(proc.pid))  # a dead holder's PID
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 0
    err = capsys.readouterr().err
    if code != 0:
        assert f"took over the stale lock of {run} left by pid {proc.pid}" in err
    assert rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl")) == \
        rd.strip_timing(rd.read_jsonl(reference / "metrics.jsonl"))
    assert rd.read_jsonl(run / "eval.jsonl") == rd.read_jsonl(reference / "eval.jsonl")
    assert rd.same_weights(rd.weights(run), rd.weights(reference))
