"""A damaged newest checkpoint (each of its files truncated, overwritten with garbage, one bit
flipped, or deleted; LATEST bad): ``--resume`` says which checkpoint it skipped and why and
continues from the previous one; leftovers of interrupted writes are removed at start."""

import shutil

import pytest

from remoe import rundir
from remoe.cli import main
from remoe.train import checkpoint as ckpt_io


@pytest.fixture(scope="module")
def finished(tmp_path_factory, train_argv):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("corrupt")
    assert main(train_argv(out, "src")) == 0
    return out / "src"


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00garbage\xff" * 16)
    elif how == "bitflip":  # one bit in the middle: same size, different content
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    elif how == "delete":
        path.unlink()


FILES = ["model.safetensors", "trainer_state.pt", "config.json", "tokenizer.json",
         "generation_config.json", "checksums.json"]


@pytest.mark.parametrize("how", ["truncate", "garbage", "bitflip", "delete"])
def test_each_damaged_file_makes_resume_take_the_previous_checkpoint(finished, how, tmp_path,
                                                                     capsys):
    for name in FILES:
        root = tmp_path / name / "checkpoints"
        shutil.copytree(finished / "checkpoints", root)
        _damage(root / "step_0000006" / name, how)
        capsys.readouterr()
        ckpt, state = ckpt_io.find_resume_checkpoint(root)
        err = capsys.readouterr().err
        if name == "checksums.json" and how == "delete":
            # every other file is intact, but a run that writes manifests never trusts one of
            # its own checkpoints without one
            assert "missing checksums.json (this run writes one" in err, err
        assert ckpt.name == "step_0000004" and state["step"] == 4, (name, how)
        assert "skipped checkpoint step_0000006" in err, (name, how, err)
        reason = err.split("skipped checkpoint step_0000006: ")[1].splitlines()[0]
        if name != "checksums.json":
            assert name in reason, (name, how, reason)
        assert (root / "LATEST").read_text() == "step_0000004"  # repaired
        assert (root / "damaged-step_0000006").is_dir()  # kept for inspection, never resumed
        assert not (root / "step_0000006").exists()


@pytest.mark.parametrize("latest", ["garbage", "missing_dir", "deleted", "older"])
def test_bad_latest_is_reported_and_the_newest_verified_checkpoint_used(finished, latest,
                                                                        tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(finished / "checkpoints", root)
    marker = root / "LATEST"
    {"garbage": lambda: marker.write_bytes(b"\xff\xfe\x00junk"),
     "missing_dir": lambda: marker.write_text("step_0000099"),
     "deleted": marker.unlink,
     "older": lambda: marker.write_text("step_0000002")}[latest]()
    ckpt, _ = ckpt_io.find_resume_checkpoint(root)
    err = capsys.readouterr().err
    assert ckpt.name == "step_0000006"
    assert "checkpoints/LATEST" in err and "using the newest complete checkpoint step_0000006" in err
    assert marker.read_text() == "step_0000006"


def test_no_verified_checkpoint_is_a_one_line_error(finished, tmp_path, train_argv, capsys):
    run = tmp_path / "src"
    shutil.copytree(finished, run)
    for c in rundir.checkpoint_dirs(run / "checkpoints"):
        _damage(c / "trainer_state.pt", "truncate")
    capsys.readouterr()
    assert main(train_argv(tmp_path, "src", "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("remoe train: error: --resume: no checkpoint under")
    assert "verifies" in err[-1] and "size mismatch of trainer_state.pt" in err[-1]


def test_bit_flip_in_weights_then_resume_end_to_end(finished, tmp_path, train_argv, rd, capsys):
    """A bit flip in the newest weights (silently resumed before): skipped, the run continues
    from step 4 to the same result; temporaries of interrupted writes are removed first."""
    run = tmp_path / "src"
    shutil.copytree(finished, run)
    _damage(run / "checkpoints" / "step_0000006" / "model.safetensors", "bitflip")
    leftovers = [run / "checkpoints" / ".step_0000008.tmp4242", run / ".final.tmp4242",
                 run / "checkpoints" / ".LATEST.tmp4242", run / ".config.yaml.tmp4242",
                 run / ".metrics.jsonl.tmp4242"]
    for p in leftovers:
        if p.name.startswith((".step", ".final")):
            p.mkdir()
            (p / "model.safetensors").write_bytes(b"half")
        else:
            p.write_text("half")
    capsys.readouterr()
    assert main(train_argv(tmp_path, "src", "--resume")) == 0
    err = capsys.readouterr().err
    assert "removed 5 leftover(s) of interrupted writes" in err
    assert "skipped checkpoint step_0000006: checksum mismatch of model.safetensors" in err
    assert not any(p.exists() for p in leftovers)
    assert rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl")) == \
        rd.strip_timing(rd.read_jsonl(finished / "metrics.jsonl"))
    assert [e["step"] for e in rd.read_jsonl(run / "eval.jsonl")] == [3, 6]
    assert rd.same_weights(rd.weights(run), rd.weights(finished))
    assert rundir.verify_manifest(run / "checkpoints" / "step_0000006") is None
