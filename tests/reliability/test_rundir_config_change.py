"""``--resume`` with a changed config: a changed model is refused in one line naming the field
(before any data or model work); changed training fields are warned about one line each, and
the run's old config.yaml is kept as config.yaml.prev-<step>."""

import shutil

import pytest
import yaml

from remoe.cli import main
from remoe.experiment import load_config
from remoe.train.trainer import Trainer
from remoe.errors import ConfigError


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, train_argv):
    out = tmp_path_factory.mktemp("cfgchange")
    assert main(train_argv(out, "c", **{"train.max_steps": 2, "train.eval_every": 0})) == 0
    return out / "c"


def test_changed_model_is_refused_in_one_line(short_run, tmp_path, train_argv, capsys,
                                               monkeypatch):
    run = tmp_path / "c"
    shutil.copytree(short_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    import remoe.data

    def no_data(*a, **k):  # the refusal comes before any data work
        raise AssertionError("data was prepared")

    monkeypatch.setattr(remoe.data, "prepare_data", no_data)
    capsys.readouterr()
    rc = main(train_argv(tmp_path, "c", "--resume", **{"train.max_steps": 2,
                                                        "train.eval_every": 0,
                                                        "model.num_experts": 16}))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == ("remoe train: error: --resume: model.num_experts=16 differs from the run's "
                      "8; start a new run or use --overwrite")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_trainer_refuses_changed_model_too(short_run, tmp_path, train_argv):
    """The API path (no CLI) refuses as well, with the same one line."""
    run = tmp_path / "c"
    shutil.copytree(short_run, run)
    argv = train_argv(tmp_path, "c", **{"train.max_steps": 2, "model.hidden_size": 96})
    cfg = load_config(None, [a.removeprefix("--set=") for a in argv if a.startswith("--set=")])
    with pytest.raises(ConfigError, match=r"model.hidden_size=96 differs from the run's \d+"):
        Trainer(cfg, resume=True, progress=False)
    assert (run / ".lock").read_text() == ""  # the refused start released the directory


def test_changed_training_fields_warn_and_keep_the_old_config(short_run, tmp_path, train_argv,
                                                              capsys):
    run = tmp_path / "c"
    shutil.copytree(short_run, run)
    old_text = (run / "config.yaml").read_text()
    capsys.readouterr()
    rc = main(train_argv(tmp_path, "c", "--resume", **{"train.max_steps": 3,
                                                        "train.eval_every": 0,
                                                        "train.lr": 0.001}))
    err = capsys.readouterr().err
    assert rc == 0
    warned = [ln for ln in err.splitlines() if ln.startswith("remoe train: warning: --resume:")]
    assert warned == [
        "remoe train: warning: --resume: train.lr=0.001 differs from the run's 0.002 "
        "(continuing with 0.001)",
        "remoe train: warning: --resume: train.max_steps=3 differs from the run's 2 "
        "(continuing with 3)"]
    assert (run / "config.yaml.prev-2").read_text() == old_text
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 0.001
