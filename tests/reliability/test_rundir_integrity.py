"""Integrity cannot be switched off: a run that writes manifests never
accepts one of its own checkpoints without ``checksums.json``; ``--resume`` with config.yaml
missing checks the model against the checkpoint's config.json; the files resume relies on are
fsync'ed (checkpoint files before their rename, the directory after it, LATEST, the metrics
lines a checkpoint counts on)."""

import os
import shutil

import pytest

from remoe import rundir
from remoe.cli import main
from remoe.errors import ConfigError
from remoe.train import checkpoint as ckpt_io
from remoe.experiment import load_config
from remoe.train.trainer import Trainer


@pytest.fixture(scope="module")
def finished(tmp_path_factory, train_argv):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("integrity")
    assert main(train_argv(out, "src")) == 0
    return out / "src"


def _flip_weight_byte(ckpt):
    p = ckpt / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01  # a weight byte, not the header: the file still loads
    p.write_bytes(bytes(data))


def test_deleted_manifest_and_flipped_weight_is_not_resumed(finished, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(finished / "checkpoints", root)
    (root / "step_0000006" / rundir.MANIFEST).unlink()
    _flip_weight_byte(root / "step_0000006")
    ckpt, state = ckpt_io.find_resume_checkpoint(root)
    err = capsys.readouterr().err
    assert ckpt.name == "step_0000004" and state["step"] == 4
    assert "skipped checkpoint step_0000006: missing checksums.json (this run writes one" in err


def test_lone_checkpoint_without_manifest_is_refused(finished, tmp_path, capsys):
    """No sibling to tell: its own trainer state says it was written with a manifest."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    shutil.copytree(finished / "checkpoints" / "step_0000006", root / "step_0000006")
    (root / "LATEST").write_text("step_0000006")
    (root / "step_0000006" / rundir.MANIFEST).unlink()
    with pytest.raises(ConfigError, match="no checkpoint under .* verifies .*missing "
                                          "checksums.json"):
        ckpt_io.find_resume_checkpoint(root)


def test_checkpoint_of_before_manifests_is_still_checked_by_loading(finished, tmp_path, capsys):
    """A checkpoint from before manifests existed (no marker, no sibling manifest) loads."""
    import torch

    root = tmp_path / "checkpoints"
    root.mkdir()
    old = root / "step_0000006"
    shutil.copytree(finished / "checkpoints" / "step_0000006", old)
    (old / rundir.MANIFEST).unlink()
    state = torch.load(old / rundir.STATE_FILE, weights_only=True)
    state.pop(rundir.MANIFEST_KEY)
    torch.save(state, old / rundir.STATE_FILE)
    ckpt, _ = ckpt_io.find_resume_checkpoint(root)
    assert ckpt == old and "no checksums.json (older format)" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("model.top_k", 2), ("model.num_experts", 16),
                                         ("model.hidden_size", 96)])
def test_missing_config_yaml_and_changed_model_is_refused_before_data(
        finished, tmp_path, train_argv, capsys, monkeypatch, field, value):
    run = tmp_path / "src"
    shutil.copytree(finished, run)
    (run / "config.yaml").unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    import remoe.data

    def no_data(*a, **k):
        raise AssertionError("data was prepared")

    monkeypatch.setattr(remoe.data, "prepare_data", no_data)
    capsys.readouterr()
    rc = main(train_argv(tmp_path, "src", "--resume", **{"train.max_steps": 8, field: value}))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"remoe train: error: --resume: {field}={value} differs from the "
                             "checkpoint's "), err
    assert "config.yaml is missing" in err[0]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_missing_config_yaml_trainer_checks_the_built_model(finished, tmp_path, train_argv):
    """The API path (no CLI pre-check) compares the model it built with config.json."""
    run = tmp_path / "src"
    shutil.copytree(finished, run)
    (run / "config.yaml").unlink()
    argv = train_argv(tmp_path, "src", **{"train.max_steps": 8, "model.top_k": 2})
    cfg = load_config(None, [a.removeprefix("--set=") for a in argv if a.startswith("--set=")])
    with pytest.raises(ConfigError, match=r"model.top_k=2 differs from the checkpoint's 1"):
        Trainer(cfg, resume=True, progress=False)


def test_missing_config_yaml_same_model_resumes(finished, tmp_path, train_argv, capsys):
    run = tmp_path / "src"
    shutil.copytree(finished, run)
    (run / "config.yaml").unlink()
    assert main(train_argv(tmp_path, "src", "--resume", **{"train.max_steps": 7})) == 0
    assert "checked against the checkpoint's config.json" in capsys.readouterr().err


def test_checkpoint_metrics_and_latest_are_fsynced_in_order(tmp_path, train_argv, monkeypatch):
    calls = []
    real = os.fsync

    def recording(fd):
        try:
            calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            calls.append("?")
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    assert main(train_argv(tmp_path, "r", **{"train.max_steps": 2, "train.eval_every": 0})) == 0
    run = str((tmp_path / "r").resolve())
    ck = f"{run}/checkpoints"
    tmp_ckpt = [i for i, p in enumerate(calls) if p.startswith(f"{ck}/.step_0000002.tmp")]
    assert tmp_ckpt, calls
    names = {os.path.basename(calls[i]) for i in tmp_ckpt}
    assert {"model.safetensors", "trainer_state.pt", "checksums.json"} <= names, names
    metrics = [i for i, p in enumerate(calls) if p == f"{run}/metrics.jsonl"]
    assert metrics and metrics[0] < tmp_ckpt[0]  # the lines a resume keeps, before the checkpoint
    root_after = [i for i, p in enumerate(calls) if p == ck and i > tmp_ckpt[-1]]
    assert root_after  # the rename into checkpoints/ is durable
    latest = [i for i, p in enumerate(calls)  # .LATEST.<random>.tmp (remoe.fileio)
              if p.startswith(f"{ck}/.LATEST.") and p.endswith(".tmp")]
    assert latest and latest[0] > root_after[0]
