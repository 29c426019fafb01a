"""No file of a run or a config runs code: a crafted
pickle in ``trainer_state.pt`` (manifest recomputed) is skipped as unreadable, a crafted
``pytorch_model.bin`` is refused by ``remoe eval``, and a ``!!python/object`` YAML tag is a
one-line config error; the payload never runs."""

import pathlib
import shutil

import torch

from remoe import rundir
from remoe.cli import main


class _Touch:
    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_crafted_trainer_state_and_weights_run_nothing(tmp_path, train_argv, capsys):
    assert main(train_argv(tmp_path, "r", **{"train.max_steps": 4, "train.eval_every": 0})) == 0
    run = tmp_path / "r"
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "step_0000004"
    torch.save({"step": 4, "x": _Touch(marker)}, ckpt / rundir.STATE_FILE)
    (ckpt / rundir.MANIFEST).unlink()
    rundir.write_manifest(ckpt)
    capsys.readouterr()
    assert main(train_argv(tmp_path, "r", "--resume", **{"train.max_steps": 4,
                                                          "train.eval_every": 0})) == 0
    err = capsys.readouterr().err
    assert "skipped checkpoint step_0000004: unreadable trainer_state.pt" in err, err
    assert not marker.exists()
    # an HF directory whose weights are a crafted pickle
    hf = tmp_path / "hf"
    shutil.copytree(run / "final", hf)
    (hf / "model.safetensors").unlink()
    torch.save({"w": _Touch(marker)}, hf / "pytorch_model.bin")
    capsys.readouterr()
    code = main(["eval", str(hf), "--tasks", "none", "--no-save", "--loss-chunks", "1"])
    assert not marker.exists()
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert code == 2 and len(err) == 1 and "nothing from it was run" in err[0], err


def test_python_object_yaml_tag_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"run:\n  name: !!python/object/apply:pathlib.Path.touch [{str(marker)!r}]\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python/object" in err[0], err
    assert not marker.exists()
