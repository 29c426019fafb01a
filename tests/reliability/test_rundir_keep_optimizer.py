"""``train.keep_optimizer=newest``: only the newest checkpoint keeps the optimizer state (the
older ones: weights, lambda controller, RNG, data position), every checkpoint still verifies,
a resume from the newest is bit-exact, and one from an older one is refused in one line."""

import os
import shutil
import signal

from remoe import rundir
from remoe.cli import main


def _sigint_after_step(step):
    def before():
        from remoe.train.trainer import Trainer

        real = Trainer.train_step

        def train_step(self):
            rec = real(self)
            if rec["step"] == step:
                os.kill(os.getpid(), signal.SIGINT)
            return rec

        Trainer.train_step = train_step
    return before


def test_only_the_newest_checkpoint_keeps_the_optimizer(tmp_path, train_argv, rd, capsys):
    ref = train_argv(tmp_path, "ref")
    assert main(ref) == 0
    argv = train_argv(tmp_path, "r", **{"train.keep_optimizer": "newest"})
    pid = rd.fork_main(argv, tmp_path / "log", before=_sigint_after_step(4))
    assert rd.wait_exit(pid) == 130
    ckpts = tmp_path / "r" / "checkpoints"
    newest, older = ckpts / "step_0000004", ckpts / "step_0000002"
    assert rundir.load_state(newest)["optimizer"] is not None
    old_state = rundir.load_state(older)
    assert old_state["optimizer"] is None and old_state["controller"] is not None
    assert rundir.verify_manifest(older) is None and rundir.verify_manifest(newest) is None
    assert (older / "trainer_state.pt").stat().st_size < (newest / "trainer_state.pt").stat(
        ).st_size / 2

    # an older checkpoint alone cannot resume bit-exactly: one line, nothing changed
    shutil.copytree(tmp_path / "r", tmp_path / "old")
    shutil.rmtree(tmp_path / "old" / "checkpoints" / "step_0000004")
    (tmp_path / "old" / "checkpoints" / "LATEST").write_text("step_0000002")
    capsys.readouterr()
    assert main(train_argv(tmp_path, "old", "--resume", **{"train.keep_optimizer": "newest"})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "step_0000002 holds no optimizer state" in err[-1]
    assert len(rd.read_jsonl(tmp_path / "old" / "metrics.jsonl")) == 4

    # the newest resumes bit for bit
    assert main(argv + ["--resume"]) == 0
    assert rd.strip_timing(rd.read_jsonl(tmp_path / "r" / "metrics.jsonl")) == rd.strip_timing(
        rd.read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    assert rd.same_weights(rd.weights(tmp_path / "r"), rd.weights(tmp_path / "ref"))
    states = [rundir.load_state(c) for c in rundir.checkpoint_dirs(ckpts)]
    assert states[0]["optimizer"] is not None and all(s["optimizer"] is None for s in states[1:])
