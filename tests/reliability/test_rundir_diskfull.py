"""A full disk during a checkpoint write: a one-line "disk full while writing <path>" error
(exit 2), no half checkpoint left, the previous checkpoint intact; once space is freed,
``--resume`` finishes the run.

The disk is a real 14 MiB tmpfs when this process may mount one (root on Linux); elsewhere the
second checkpoint's ``torch.save`` raises ``OSError(ENOSPC)`` instead (the test says which)."""

import errno
import subprocess

import pytest

from remoe import rundir
from remoe.cli import main


def _mount_tmpfs(where, size):
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """``(out_dir, grow)``: a directory on a disk with room for one micro checkpoint only."""
    fs = tmp_path / "fs"
    if _mount_tmpfs(fs, "14m"):
        print("disk full: real tmpfs")
        yield fs, lambda: subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
        subprocess.run(["umount", "-l", str(fs)], check=False)
        return
    print("disk full: simulated (torch.save raises ENOSPC)")
    import torch

    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            with open(f, "wb") as fh:
                fh.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    fs.mkdir()
    yield fs, lambda: monkeypatch.setattr(torch, "save", real)


def test_disk_full_during_a_checkpoint(small_disk, train_argv, rd, capsys):
    out, grow = small_disk
    run = out / "d"
    capsys.readouterr()
    assert main(train_argv(out, "d")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"remoe train: error: disk full while writing {run}/checkpoints/step_0000004"
    assert not [p for p in run.rglob("*") if rundir.is_temporary(p.name)]  # no half checkpoint
    ckpts = rundir.checkpoint_dirs(run / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000002"]
    assert rundir.verify_manifest(ckpts[0]) is None
    assert (run / "checkpoints" / "LATEST").read_text() == "step_0000002"

    grow()
    assert main(train_argv(out, "d", "--resume")) == 0
    assert [r["step"] for r in rd.read_jsonl(run / "metrics.jsonl")] == list(range(1, 7))
    assert [e["step"] for e in rd.read_jsonl(run / "eval.jsonl")] == [3, 6]
    assert (run / "summary.json").exists()


def test_disk_full_while_writing_metrics(small_disk, monkeypatch):
    """ENOSPC on a metrics line is said as such; the lines before it stay readable."""
    from remoe.train.metrics import MetricsWriter

    out, _ = small_disk
    w = MetricsWriter(out / "metrics.jsonl", None)
    w.write({"step": 1, "lm_loss": 5.5})
    if rundir.os.statvfs(out).f_blocks * rundir.os.statvfs(out).f_frsize <= (64 << 20):
        with open(out / "filler", "wb", buffering=0) as f:  # a real tmpfs: fill it
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
            except OSError as e:
                assert e.errno == errno.ENOSPC
    else:  # simulated: the file system reports ENOSPC to the next write
        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(rundir.os, "write", full)
    with pytest.raises(rundir.DiskFullError,
                       match=f"^disk full while writing {out}/metrics.jsonl$"):
        w.write({"step": 2, "lm_loss": 5.4, "pad": "x" * 70000})
    w.close()
    lines, bad = rundir.read_jsonl(out / "metrics.jsonl")
    assert lines[0][1] == {"step": 1, "lm_loss": 5.5}
