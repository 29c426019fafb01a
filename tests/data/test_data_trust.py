"""Data one can trust: no stale, orphaned or leftover file; mismatched token ids refused."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_text  # noqa: E402
from test_data_shards import all_tokens, prepare, write_jsonl, write_megatron  # noqa: E402


def _tokenizer(tmp_path: Path) -> Path:
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer
    tok = train_tokenizer(iter([[make_text(d, i) for d in VOCAB for i in range(5)]]), 300)
    save_tokenizer(tok, tmp_path / "tok.json")
    return tmp_path / "tok.json"


def _megatron_docs(seed: int = 1, n: int = 80, high: int = 299) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, high, size=rng.integers(20, 60))] + [0]
            for _ in range(n)]


def _rewrite_keeping_size_and_mtime(path: Path, offset: int, data: bytes) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_changed_in_place_bin_is_verified_and_rebuilt_whole(tmp_path):
    """A token changed inside a held-out document of an in-place .bin (size and mtime kept):
    --verify finds it, and the next build's held-out copy is the new .bin's, never the old."""
    from remoe.datacli import main
    from remoe.data.pipeline import load_prepared
    tok = _tokenizer(tmp_path)
    docs = _megatron_docs()
    write_megatron(tmp_path / "mt", docs)
    args = ["--source", f"web={tmp_path / 'mt'}", "--tokenizer", str(tok), "--cache-dir",
            str(tmp_path / "cache"), "--vocab-size", "300", "--quiet", "--workers", "1"]
    assert main(args) == 0
    b = load_prepared(tmp_path / "cache")
    labels = np.fromfile(b.store_root / "plan.labels.u8", dtype=np.uint8)
    held = int(np.flatnonzero(labels == 1)[0])  # the first validation document
    first_token = sum(len(d) for d in docs[:held])
    _rewrite_keeping_size_and_mtime(tmp_path / "mt.bin", 2 * first_token,
                                    np.asarray([297], dtype=np.uint16).tobytes())
    del b
    assert main([*args, "--verify"]) == 0
    b = load_prepared(tmp_path / "cache")
    new = np.fromfile(tmp_path / "mt.bin", dtype=np.uint16)
    want = new[first_token: first_token + len(docs[held])]
    assert want[0] == 297
    assert np.array_equal(b.split("validation").document(0, with_eos=True), want)


def test_verify_names_the_changed_source_and_discards_the_build(tmp_path):
    from remoe.data.streambuild import verify_store
    src = write_jsonl(tmp_path / "c.jsonl")
    b = prepare(tmp_path, [src])
    root = b.store_root
    _rewrite_keeping_size_and_mtime(src, 20, b"Z")
    problems = verify_store(tmp_path / "cache")
    assert len(problems) == 1 and str(src) in problems[0] and "sha256" in problems[0]
    assert not root.exists() and not (root.parent / "manifest.json").exists()


def test_a_resumed_build_whose_source_changed_starts_again(tmp_path, caplog):
    src = write_jsonl(tmp_path / "c.jsonl")
    b = prepare(tmp_path / "a", [src])
    (b.store_root.parent / "manifest.json").unlink()  # as if killed before its end
    _rewrite_keeping_size_and_mtime(src, 20, b"Z")  # the stat cannot tell
    resumed = all_tokens(prepare(tmp_path / "a", [src]))
    assert "discarding the interrupted build" in caplog.text
    fresh = all_tokens(prepare(tmp_path / "b", [src]))
    for s in fresh:
        assert np.array_equal(resumed[s], fresh[s])


def test_a_source_changed_during_the_build_is_refused(tmp_path, monkeypatch):
    import remoe.data.streambuild as sb
    from remoe.data.errors import DataError
    src = write_jsonl(tmp_path / "c.jsonl")
    real = sb.build_shards

    def touching(*a, **k):
        out = real(*a, **k)
        os.utime(src, ns=(1, 1))
        return out

    monkeypatch.setattr(sb, "build_shards", touching)
    with pytest.raises(DataError, match=r"c\.jsonl changed .* while the store was being built"):
        prepare(tmp_path, [src])
    assert [p.name for p in (tmp_path / "cache" / "store-v2").iterdir()] == []


def test_two_spellings_of_one_source_are_one_store(tmp_path, monkeypatch, caplog):
    src = write_jsonl(tmp_path / "c.jsonl")
    tok = _tokenizer(tmp_path)
    monkeypatch.chdir(tmp_path)
    a = prepare(tmp_path, ["c.jsonl"], cfg={"tokenizer": "tok.json"})
    b = prepare(tmp_path, [src], cfg={"tokenizer": str(tok)})
    assert a.manifest["key"] == b.manifest["key"]
    assert "building the sharded store again" not in caplog.text
    assert b.manifest["config"]["sources"] == [str(src)]


def test_workers_die_with_a_killed_build(tmp_path):
    code = """
import os, sys, time
from remoe.data.shards import process_pool
pool = process_pool(2)
waits = [pool.apply_async(time.sleep, (60,)) for _ in range(2)]
time.sleep(1.0)
print(" ".join(str(p.pid) for p in pool._pool), flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_leftovers_of_a_killed_build_are_swept(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl")
    b = prepare(tmp_path, [src])
    ref = all_tokens(b)
    root = b.store_root
    (root.parent / "manifest.json").unlink()  # killed before its end
    stray = [root / ".plan.labels.u8.abc.tmp", root / ".plan.dedup.u8.abc.tmp",
             root / "shards" / ".u000001.bin.xyz.tmp",
             root / "index" / ".train.doc_offsets.npy.tmp",
             root / "dedup" / "run00000.u64", root.parent / ".discard-0123-99" / "plan.json"]
    for p in stray:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 100)
    orphan = root / "shards" / "u000999.bin"  # written by a worker that outlived its build
    orphan.write_bytes(b"\0\0")
    again = prepare(tmp_path, [src])
    assert not any(p.exists() for p in stray) and not orphan.exists()
    assert not (root.parent / ".discard-0123-99").exists()
    for s, arr in all_tokens(again).items():
        assert np.array_equal(arr, ref[s])


def test_a_full_disk_leaves_no_file_of_the_failed_unit(tmp_path, monkeypatch):
    import remoe.data.shards as shards
    from remoe.data.errors import DataError
    src = write_jsonl(tmp_path / "c.jsonl")
    real = shards.encode_unit

    def full_at_unit_2(job):
        meta = real(job)  # its files are in place, but its journal line never comes
        if job["unit"] == 2:
            (Path(job["out_dir"]) / ".u000003.bin.abc.tmp").write_bytes(b"x")  # a unit in flight
            raise OSError(errno.ENOSPC, "No space left on device", job["out_dir"])
        return meta

    monkeypatch.setattr(shards, "encode_unit", full_at_unit_2)
    with pytest.raises(DataError, match="disk full while writing the data cache"):
        prepare(tmp_path, [src])
    shard_dir = next((tmp_path / "cache" / "store-v2").glob("*/shards"))
    names = sorted(p.name for p in shard_dir.iterdir())
    assert names == ["journal.jsonl"] + sorted(shards.unit_name(u, w) for u in (0, 1) for w in
                                               ("bin", "heldout.jsonl", "lens.npy"))


def test_megatron_without_a_tokenizer_is_refused_before_any_work(tmp_path):
    from remoe.datacli import main
    write_megatron(tmp_path / "mt", _megatron_docs(high=8000))
    args = ["--source", f"web={tmp_path / 'mt'}", "--cache-dir", str(tmp_path / "cache"),
            "--quiet", "--workers", "1"]
    from remoe.data.errors import DataError
    with pytest.raises(DataError, match=r"'web=.*mt' \(mt\.bin: largest token id 7,99\d\) is "
                                        r"already tokenised.*BPE of 300 ids"):
        prepare(tmp_path, [f"web={tmp_path / 'mt'}"])
    assert main(args) == 2
    store = tmp_path / "cache" / "store-v2"
    assert not store.exists() or list(store.iterdir()) == []  # no plan, no unit


@pytest.mark.parametrize("dtype", ["<u2", "<i4"])
def test_megatron_ids_beyond_the_tokenizer_are_refused(tmp_path, dtype):
    from remoe.data.errors import DataError
    tok = _tokenizer(tmp_path)
    docs = _megatron_docs()
    bad = docs[5][3] = 67865 if dtype == "<i4" else 400
    write_megatron(tmp_path / "mt", docs, dtype)
    with pytest.raises(DataError, match=rf"'web=.*mt' \(mt\.bin: largest token id {bad:,}\): "
                                        rf"{bad:,} does not fit the tokenizer .*tok\.json "
                                        r"\(vocabulary 300"):
        prepare(tmp_path, [f"web={tmp_path / 'mt'}"], cfg={"tokenizer": str(tok)})


def test_the_store_records_its_largest_id_and_training_checks_it(tmp_path, monkeypatch):
    from remoe.data.errors import DataError
    from remoe.train.runtime import prepare_run_data
    tok = _tokenizer(tmp_path)
    docs = _megatron_docs(high=250)
    write_megatron(tmp_path / "mt", docs)
    b = prepare(tmp_path, [f"web={tmp_path / 'mt'}"], cfg={"tokenizer": str(tok)})
    assert b.max_token_id == max(max(d) for d in docs) < b.vocab_size
    b.check_vocabulary(b.vocab_size, "model.vocab_size")
    with pytest.raises(DataError, match=r"its tokens go up to id 24\d, beyond model.vocab_size "
                                        r"\(200 ids\)"):
        b.check_vocabulary(200, "model.vocab_size")
    b.manifest["tokens"]["max_id"] = 300  # as a store of mismatched ids would say
    import remoe.data
    monkeypatch.setattr(remoe.data, "prepare_data", lambda cfg, progress: b)
    with pytest.raises(DataError, match="up to id 300, beyond the tokenizer's vocabulary"):
        prepare_run_data(None, True, False, lambda: None)


def test_a_journal_line_cut_short_does_not_swallow_the_next(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl")
    b = prepare(tmp_path, [src])
    ref = all_tokens(b)
    journal = b.store_root / "shards" / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:2]) + lines[2][:25])  # killed while writing unit 2's
    (b.store_root.parent / "manifest.json").unlink()
    again = prepare(tmp_path, [src])
    kept = journal.read_bytes().splitlines(keepends=True)
    assert kept[:2] == lines[:2] and all(json.loads(ln)["unit"] >= 0 for ln in kept)
    assert len(kept) == len(lines)
    for s, arr in all_tokens(again).items():
        assert np.array_equal(arr, ref[s])
