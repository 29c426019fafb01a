"""Sharded (DCP, ``train.fsdp=true``) checkpoints run no code from their files.

torch reads ``dcp/.metadata`` with plain pickle and the non-tensor values of a shard with
torch's full unpickler (``weights_only`` off); remoe reads both through :mod:`remoe.rundir.dcpread`. A crafted
``.metadata`` and a crafted shard value (``checksums.json`` recomputed, as anyone able to write
the files can) give a one-line error, exit 2, and their payload never runs, on ``--resume`` and
on ``remoe eval``; a genuine sharded checkpoint still resumes bit for bit and evaluates.
"""

import io
import pathlib
import pickle
import shutil

import pytest
import torch

from remoe import rundir
from remoe.rundir import dcpread
from remoe.cli import main

STEPS = {"train.fsdp": "true", "train.max_steps": 6, "train.save_every": 2}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, train_argv):
    """A finished one-process FSDP run with sharded checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("dcp")
    assert main(train_argv(out, "src", **STEPS)) == 0
    assert (out / "src/checkpoints/step_0000006/dcp/.metadata").is_file()
    return out / "src"


class _Touch:
    """A pickle payload: unpickling it creates ``path`` (stands for any code)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _craft_metadata(ckpt, marker):
    """``.metadata`` = the genuine metadata with a payload inside; manifest recomputed."""
    path = ckpt / "dcp" / ".metadata"
    md = pickle.loads(path.read_bytes())  # the genuine file, written by this test's own run
    md.planner_data = {"x": _Touch(marker)}
    path.write_bytes(pickle.dumps(md))
    (ckpt / rundir.MANIFEST).unlink()
    rundir.write_manifest(ckpt)


def _craft_shard_value(ckpt, marker):
    """A non-tensor value of the shard (an AdamW hyper-parameter) replaced by a pickle payload
    appended to the shard file; metadata and manifest updated to point at it."""
    md_path = ckpt / "dcp" / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    key = next(k for k in md.storage_data if k.fqn.endswith("param_groups.0.lr"))
    info = md.storage_data[key]
    shard = ckpt / "dcp" / info.relative_path
    buf = io.BytesIO()
    torch.save(_Touch(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    md_path.write_bytes(pickle.dumps(md))
    (ckpt / rundir.MANIFEST).unlink()
    rundir.write_manifest(ckpt)


def _copy(sharded, tmp_path):
    run = tmp_path / "src"
    shutil.copytree(sharded, run)
    return run


def test_torch_own_reader_would_run_the_crafted_metadata(sharded, tmp_path):
    """The crafted file is a real threat: torch's FileSystemReader runs its payload."""
    from torch.distributed.checkpoint import FileSystemReader

    run = _copy(sharded, tmp_path)
    marker = tmp_path / "ran"
    _craft_metadata(run / "checkpoints/step_0000006", marker)
    FileSystemReader(str(run / "checkpoints/step_0000006/dcp")).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("craft", [_craft_metadata, _craft_shard_value])
def test_crafted_sharded_checkpoint_runs_nothing_on_resume(sharded, tmp_path, train_argv,
                                                           capsys, craft):
    run = _copy(sharded, tmp_path)
    marker = tmp_path / "ran"
    craft(run / "checkpoints/step_0000006", marker)
    capsys.readouterr()
    code = main(train_argv(tmp_path, "src", "--resume", **{**STEPS, "train.max_steps": 8}))
    err = capsys.readouterr().err
    assert not marker.exists(), "the payload ran"
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("remoe")]
    assert "refusing to load it" in lines[-1] and "Traceback" not in err, err


@pytest.mark.parametrize("craft", [_craft_metadata, _craft_shard_value])
def test_crafted_sharded_checkpoint_runs_nothing_on_eval(sharded, tmp_path, capsys, craft):
    run = _copy(sharded, tmp_path)
    marker = tmp_path / "ran"
    craft(run / "checkpoints/step_0000006", marker)
    capsys.readouterr()
    code = main(["eval", str(run / "checkpoints/step_0000006"), "--tasks", "none",
                 "--loss-chunks", "1", "--out", str(tmp_path / "ev.json")])
    err = capsys.readouterr().err
    assert not marker.exists(), "the payload ran"
    if craft is _craft_shard_value:  # eval reads the model only, never the optimizer's values
        assert code == 0, err
    else:
        assert code == 2 and "refusing to load it" in err and "Traceback" not in err, err


def test_allow_list_refuses_code_and_reads_the_genuine_metadata(sharded, tmp_path):
    genuine = sharded / "checkpoints/step_0000006/dcp/.metadata"
    assert dcpread.load_metadata(genuine) == pickle.loads(genuine.read_bytes())
    for payload in [_Touch(tmp_path / "ran"), print, {"a": [1, (2, torch.Size([3]))], "b": eval}]:
        bad = tmp_path / "bad.metadata"
        bad.write_bytes(pickle.dumps(payload))
        with pytest.raises(dcpread.UnsafeCheckpointError):
            dcpread.load_metadata(bad)
    assert not (tmp_path / "ran").exists()
    for junk in [b"", b"\x80\x04garbage", genuine.read_bytes()[:100]]:
        bad.write_bytes(junk)
        with pytest.raises(dcpread.UnsafeCheckpointError):
            dcpread.load_metadata(bad)


def test_genuine_sharded_checkpoint_resumes_bit_exactly(sharded, tmp_path, train_argv, rd):
    run = _copy(sharded, tmp_path)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_0000006")
    (ckpts / "LATEST").write_text("step_0000004")
    assert main(train_argv(tmp_path, "src", "--resume", **STEPS)) == 0
    a = rd.strip_timing(rd.read_jsonl(sharded / "metrics.jsonl"))
    b = rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b
    assert rd.same_weights(rd.weights(sharded), rd.weights(run))


def test_eval_reads_a_sharded_checkpoint(sharded, tmp_path):
    import json

    out = tmp_path / "ev.json"
    assert main(["eval", str(sharded / "checkpoints/step_0000004"), "--tasks", "none",
                 "--loss-chunks", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["models"][0]
    assert rec["loss"]["loss"] > 0 and rec["loss_skipped"] is None
