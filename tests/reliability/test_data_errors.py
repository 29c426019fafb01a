"""Bad data is a one-line error naming the source (exit 2 via the CLI) or an
explicit warning with counts, never a traceback and never silently used in part."""

from __future__ import annotations

import errno
import fcntl
import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from remoe.data import DataConfig, assign_splits, prepare_data, split_unit
from remoe.data.documents import Document
from remoe.errors import ConfigError

from .conftest import data_cfg, doc_text, one_line_error, txt_corpus


def _jsonl_bytes(n: int) -> bytes:
    return b"".join(json.dumps({"text": doc_text(i), "meta": {"pile_set_name": "web"}}).encode()
                    + b"\n" for i in range(n))


def _cli_data(argv: list[str], capsys) -> tuple[int, str]:
    from remoe.cli import main

    rc = main(["data", "--quiet", *argv])
    return rc, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A complete cache of a small two-domain corpus (built once; copy it before changing it)."""
    base = tmp_path_factory.mktemp("built")
    src = txt_corpus(base / "corpus")
    cfg = data_cfg(base, src)
    prepare_data(cfg, progress=False)
    return cfg


def _copy_cache(built: DataConfig, tmp_path: Path) -> DataConfig:
    dst = tmp_path / "cache"
    shutil.copytree(built.cache_dir, dst)
    return DataConfig(**{**built.to_dict(), "cache_dir": str(dst)})


# -- sources ----------------------------------------------------------------------------------


def test_no_documents_is_one_line_naming_the_sources(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    msg = one_line_error(data_cfg(tmp_path, empty))
    assert msg.startswith("no documents found") and str(empty) in msg
    rc, err = _cli_data(["--source", str(empty), "--cache-dir", str(tmp_path / "c")], capsys)
    assert rc == 2 and "no documents found" in err and err.count("\n") == 0
    assert err.startswith("remoe data: error: ")  # the command named, as every command does


def test_no_documents_under_remoe_train_is_exit_2_not_a_traceback(tmp_path, capsys):
    from remoe.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    rc = main(["train", "--set", f"data.sources=[{empty}]", "--set",
               f"data.cache_dir={tmp_path / 'c'}", "--set", f"run.out_dir={tmp_path / 'runs'}",
               "--set", "model.preset=micro", "--set", "data.vocab_size=300"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no documents found" in err and err.count("\n") == 0


def test_truncated_jsonl_gz_names_file_and_progress(tmp_path):
    data = gzip.compress(_jsonl_bytes(100))
    f = tmp_path / "src" / "part.jsonl.gz"
    f.parent.mkdir()
    f.write_bytes(data[: len(data) // 2])
    msg = one_line_error(data_cfg(tmp_path, f.parent))
    assert str(f) in msg and "truncated" in msg and "documents" in msg


def test_garbage_jsonl_gz_and_zst(tmp_path):
    for name in ("g.jsonl.gz", "g.jsonl.zst"):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_bytes(os.urandom(4096))
        msg = one_line_error(data_cfg(tmp_path, d))
        assert str(d / name) in msg and "corrupt or truncated" in msg


def test_truncated_jsonl_zst_is_an_error_not_silently_partial(tmp_path):
    import zstandard

    data = zstandard.ZstdCompressor(level=3).compress(_jsonl_bytes(100))
    d = tmp_path / "src"
    d.mkdir()
    (d / "part.jsonl.zst").write_bytes(data[: len(data) // 2])
    msg = one_line_error(data_cfg(tmp_path, d))
    assert "part.jsonl.zst" in msg and "truncated" in msg and " lines " in msg
    # the complete file (and a multi-frame one) still reads every document
    multi = data + zstandard.ZstdCompressor(level=1).compress(_jsonl_bytes(3))
    (d / "part.jsonl.zst").write_bytes(multi)
    from remoe.data import read_jsonl

    assert len(list(read_jsonl(d / "part.jsonl.zst"))) == 103


def test_binary_txt_is_rejected_small_nul_count_is_warned(tmp_path, caplog):
    src = txt_corpus(tmp_path / "corpus", docs=4)
    blob = src / "alpha" / "image.txt"
    blob.write_bytes(bytes(range(256)) * 64)  # NULs and control bytes throughout
    msg = one_line_error(data_cfg(tmp_path, src))
    assert str(blob) in msg and "binary" in msg
    blob.write_bytes("UTF-16 text".encode("utf-16"))
    assert "binary" in one_line_error(data_cfg(tmp_path, src))
    # one stray NUL in a long text file: used, and said so with the count
    blob.write_bytes(doc_text(7, 400).encode() + b"\x00")
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        prepare_data(data_cfg(tmp_path, src), progress=False)
    assert "dropped 1 NUL bytes" in caplog.text


# -- splits -----------------------------------------------------------------------------------


def test_one_document_domain_always_trains():
    val = 0.2
    keys = [f"doc{i}" for i in range(200)]
    held_out_by_hash = [k for k in keys if split_unit("solo", k) < val]
    assert held_out_by_hash  # the hash alone would put these in validation
    for k in held_out_by_hash[:20]:
        s = assign_splits({"solo": [Document("solo", k, "text")]}, val, 0.1)
        assert [d.key for d in s["train"]] == [k] and not s["validation"]
    # two documents: one trains, one validates, whatever their hashes
    for a, b in zip(keys[:40:2], keys[1:40:2]):
        s = assign_splits({"d": [Document("d", a, "x"), Document("d", b, "y")]}, 0.03, 0.03)
        assert len(s["train"]) == 1 and len(s["validation"]) == 1


def test_one_document_corpus_is_an_error_not_an_empty_split(tmp_path, capsys):
    f = tmp_path / "one" / "only.txt"
    f.parent.mkdir()
    f.write_text(doc_text(1, 400))
    msg = one_line_error(data_cfg(tmp_path, f.parent))
    assert "validation split is empty" in msg and "1 document(s)" in msg
    assert "add documents" in msg
    rc, err = _cli_data(["--source", str(f.parent), "--cache-dir", str(tmp_path / "c"),
                         "--vocab-size", "300"], capsys)
    assert rc == 2 and "validation split is empty" in err


def _short_validation(tmp_path: Path) -> tuple[DataConfig, int]:
    """A corpus whose validation domains are all shorter than one chunk of ``seq_len + 1``
    tokens while train has full chunks; returns its config and that ``seq_len``."""
    src = txt_corpus(tmp_path / "corpus", docs=10, n_words=15)
    cfg = data_cfg(tmp_path, src)
    bundle = prepare_data(cfg, progress=False)
    seq_len = max(bundle.split("validation").tokens_per_domain().values())
    assert max(bundle.split("train").tokens_per_domain().values()) > seq_len + 1
    return cfg, seq_len


def test_validation_without_a_full_chunk_fails_before_training(tmp_path):
    cfg, seq_len = _short_validation(tmp_path)
    bundle = prepare_data(cfg, progress=False)
    bundle.train_batches(seq_len=8, micro_batch=2)  # fine with short sequences
    with pytest.raises(ConfigError, match=f"validation split has no chunk of {seq_len + 1} "):
        bundle.train_batches(seq_len=seq_len, micro_batch=2)


def test_remoe_train_never_writes_nan_val_loss(tmp_path, capsys):
    from remoe.cli import main

    cfg, seq_len = _short_validation(tmp_path)
    runs = tmp_path / "runs"
    sets = [f"data.sources=[{cfg.sources[0]}]", f"data.cache_dir={cfg.cache_dir}",
            f"run.out_dir={runs}", "run.name=r", "model.preset=micro", "data.vocab_size=300",
            "model.max_position_embeddings=4096",
            "data.val_fraction=0.2", "data.test_fraction=0.1", f"train.seq_len={seq_len}",
            "train.max_steps=2", "train.micro_batch_size=1", "train.log_every=0",
            "analysis.record_masks_every=0"]
    rc = main(["train", "--no-progress"] + [a for x in sets for a in ("--set", x)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "validation split has no chunk" in err[-1]
    summary = runs / "r" / "summary.json"
    assert not summary.exists() or "NaN" not in summary.read_text()


# -- cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", ["[]", '"text"', '{"format": "remoe-shards/1", "dir": 5}',
                                      '{"format": "remoe-shards/1", "dir": "x", "shards": 3}'])
def test_malformed_manifest_is_a_corrupt_cache_rebuilt(built_cache, tmp_path, manifest):
    from remoe.data import load_prepared

    cfg = _copy_cache(built_cache, tmp_path)
    (Path(cfg.cache_dir) / "store-v2" / "manifest.json").write_text(manifest)
    with pytest.raises(FileNotFoundError, match="no complete data cache"):
        load_prepared(cfg.cache_dir)
    bundle = prepare_data(cfg, progress=False)
    assert bundle.split("train").num_docs > 0
    assert load_prepared(cfg.cache_dir).domains == ["alpha", "beta"]


def test_complete_cache_is_readable_when_nothing_may_be_written(built_cache, tmp_path,
                                                                monkeypatch):
    """In-process stand-in for a read-only mount: every write under the cache fails (EROFS)."""
    import builtins
    import tempfile as _tempfile

    cfg = _copy_cache(built_cache, tmp_path)
    cache = Path(cfg.cache_dir).resolve()
    real_open, real_mkstemp = builtins.open, _tempfile.mkstemp

    def inside(p) -> bool:
        return Path(os.path.abspath(p)).is_relative_to(cache)

    def ro_open(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and inside(file) and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *a, **k)

    def ro_mkstemp(*a, dir=None, **k):
        if dir is not None and inside(dir):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(builtins, "open", ro_open)
    monkeypatch.setattr(_tempfile, "mkstemp", ro_mkstemp)
    bundle = prepare_data(cfg, progress=False)
    assert bundle.split("train").num_docs > 0
    # a cache that needs a rebuild says so in one line instead of failing somewhere inside
    monkeypatch.setattr(builtins, "open", real_open)
    (cache / "store-v2" / "manifest.json").write_text("[]")
    monkeypatch.setattr(builtins, "open", ro_open)
    msg = one_line_error(cfg)
    assert "not writable" in msg and str(Path(cfg.cache_dir)) in msg


def _can_bind_mount_read_only() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind -o ro /tmp /tmp"],
                       capture_output=True)
    if r.returncode == 0:
        return True
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount --bind /tmp /tmp && "
                        "mount -o remount,bind,ro /tmp"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_bind_mount_read_only(), reason="cannot bind-mount read-only here")
def test_complete_cache_on_a_read_only_mount(built_cache, tmp_path):
    cfg = _copy_cache(built_cache, tmp_path)
    cache, src = cfg.cache_dir, cfg.sources[0]
    probe = ("from remoe.data import DataConfig, prepare_data; import json, sys; "
             "b = prepare_data(DataConfig(**json.loads(sys.argv[1])), progress=False); "
             "print('docs', b.split('train').num_docs)")
    inner = (f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && "
             f"touch {cache}/x 2>/dev/null && echo WRITABLE; "
             f"{sys.executable} -c \"$0\" '{json.dumps(cfg.to_dict())}'")
    for argv in (["unshare", "-m"], ["unshare", "-Urm"]):
        r = subprocess.run([*argv, "sh", "-c", inner, probe], capture_output=True, text=True,
                           timeout=120)
        if "mount:" not in r.stderr:
            break
    assert "WRITABLE" not in r.stdout, "the bind mount is not read-only"
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("docs ")
    assert Path(src).is_dir()


def test_second_remoe_data_says_whose_lock_it_waits_for(built_cache, tmp_path, caplog):
    """Another process holds the cache lock (here: a second open file description, as flock
    sees another process); prepare_data says at once whom it waits for, then proceeds."""
    cfg = _copy_cache(built_cache, tmp_path)
    lock = Path(cfg.cache_dir) / ".lock"
    holder_pid = 4242  # what the holder wrote into the lock file
    result: list = []
    with open(lock, "a+b") as fh, caplog.at_level(logging.WARNING, logger="remoe.data"):
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        fh.truncate(0)
        fh.write(f"{holder_pid}\n".encode())
        fh.flush()
        worker = threading.Thread(target=lambda: result.append(prepare_data(cfg, progress=False)),
                                  daemon=True)
        worker.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and "waiting" not in caplog.text:
            time.sleep(0.02)
        assert f"waiting for the lock held by PID {holder_pid} on {lock}" in caplog.text
        assert not result and worker.is_alive()  # it really waits
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    worker.join(timeout=60)
    assert result and result[0].split("train").num_docs > 0
    assert lock.read_bytes() == b""  # the PID is cleared when the lock is released


def test_cache_dir_that_is_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for cache in (f, f / "sub"):
        with pytest.raises(ConfigError, match="data.cache_dir=.* is a file"):
            DataConfig(cache_dir=str(cache)).validate()
