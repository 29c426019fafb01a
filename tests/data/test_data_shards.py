"""The sharded store: every input kind, resume after a kill, corruption, start-up, workers."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_text  # noqa: E402

TINY_SHARD_BYTES = 3000  # several units per split, forced by the setting


def _records(n_per_domain: int = 12):
    for i in range(n_per_domain):
        for dom in VOCAB:
            yield {"text": make_text(dom, i, 60), "meta": {"pile_set_name": dom}}


def write_jsonl(path: Path, compress: str = "") -> Path:
    data = "".join(json.dumps(r) + "\n" for r in _records()).encode()
    if compress == "gz":
        data = gzip.compress(data)
    elif compress == "zst":
        import zstandard
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def prepare(tmp: Path, sources, **kw):
    from remoe.data import DataConfig, prepare_data
    cfg = DataConfig(sources=[str(s) for s in sources], cache_dir=str(tmp / "cache"),
                     vocab_size=300, **kw.pop("cfg", {}))
    return prepare_data(cfg, progress=False, shard_bytes=kw.pop("shard_bytes", TINY_SHARD_BYTES),
                        **kw)


def all_tokens(bundle):
    return {s: bundle.split(s).read(0, bundle.split(s).num_tokens) for s in
            ("train", "validation", "test")}


def test_jsonl_kinds_give_the_same_store(tmp_path):
    plain = prepare(tmp_path / "a", [write_jsonl(tmp_path / "c.jsonl")])
    for kind in ("gz", "zst"):
        other = prepare(tmp_path / kind, [write_jsonl(tmp_path / f"c.jsonl.{kind}", kind)])
        # keys name the file, so the splits may differ: compare what every document became
        assert sorted(other.domains) == sorted(plain.domains) == sorted(VOCAB)
        assert sum(other.split(s).num_docs for s in ("train", "validation", "test")) == 36
    assert len(plain.manifest["shards"]) > 2


def test_directory_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "a.jsonl")
    recs = list(_records())
    pq.write_table(pa.table({"body": [r["text"] + " pq" for r in recs],
                             "src": [r["meta"]["pile_set_name"] for r in recs]}),
                   d / "b.parquet", row_group_size=7)
    b = prepare(tmp_path, [f"{d}?text=body&domain=src"])
    docs = sum(b.split(s).num_docs for s in ("train", "validation", "test"))
    assert docs == 72 and sorted(b.domains) == sorted(VOCAB)
    held = b.documents("validation") + b.documents("test")
    assert any(doc.key.startswith("dir/b.parquet:") for doc in held)


def test_parquet_missing_column_is_one_line_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from remoe.errors import ConfigError
    pq.write_table(pa.table({"body": ["x y z"] * 5}), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match="no column 'text'"):
        prepare(tmp_path, [tmp_path / "b.parquet"])


def write_megatron(prefix: Path, docs: list[list[int]], dtype: str = "<u2") -> None:
    import struct
    arr = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]).astype(dtype)
    prefix.with_suffix(".bin").write_bytes(arr.tobytes())
    sizes = np.asarray([len(d) for d in docs], dtype="<i4")
    ptrs = np.concatenate([[0], np.cumsum(sizes[:-1]) * arr.itemsize]).astype("<i8")
    bounds = np.arange(len(docs) + 1, dtype="<i8")
    code = {"<u2": 8, "<i4": 4}[dtype]  # Megatron-core's dtype codes
    head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1)
    prefix.with_suffix(".idx").write_bytes(head + sizes.tobytes() + ptrs.tobytes() +
                                           bounds.tobytes())


def test_megatron_source_documents_keep_their_tokens(tmp_path):
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer
    tok = train_tokenizer(iter([[make_text(d, i) for d in VOCAB for i in range(5)]]), 300)
    save_tokenizer(tok, tmp_path / "tok.json")
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 299, size=rng.integers(20, 60))) + [0] for _ in range(40)]
    write_megatron(tmp_path / "mt", docs)
    b = prepare(tmp_path, [f"web={tmp_path / 'mt'}"], cfg={"tokenizer": str(tmp_path / "tok.json")})
    got = []
    for s in ("train", "validation", "test"):
        st = b.split(s)
        got += [list(st.document(i, with_eos=True)) for i in range(st.num_docs)]
    assert sorted(map(tuple, got)) == sorted(map(tuple, docs))  # no token lost or added
    assert b.domains == ["web"]


def test_resume_after_kill_is_bit_identical(tmp_path, caplog):
    src = write_jsonl(tmp_path / "c.jsonl")
    whole = prepare(tmp_path / "whole", [src])
    ref = all_tokens(whole)
    # a build killed (-9) after its third unit: the child dies inside the journal callback
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from remoe.data import shards
real = shards.build_shards
def dying(units, out_dir, job, workers, on_unit):
    n = [0]
    def cb(meta, enc):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), 9)
        on_unit(meta, enc)
    return real(units, out_dir, job, workers, cb)
import remoe.data.streambuild as sb
sb.build_shards = dying
from remoe.data import DataConfig, prepare_data
prepare_data(DataConfig(sources=[{str(src)!r}], cache_dir={str(tmp_path / 'k' / 'cache')!r},
             vocab_size=300), progress=False, shard_bytes={TINY_SHARD_BYTES})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert r.returncode == -9
    store = tmp_path / "k" / "cache" / "store-v2"
    assert not (store / "manifest.json").exists()  # nothing half-built is ever used
    journal = next(store.glob("*/shards/journal.jsonl"))
    first = journal.read_text().splitlines()
    assert len(first) == 3
    written = {p: p.stat().st_mtime_ns for p in journal.parent.glob("u00000[0-2].bin")}
    resumed = prepare(tmp_path / "k", [src])
    assert "resuming an interrupted build (plan done, 3 unit(s) finished)" in caplog.text
    for p, t in written.items():
        assert p.stat().st_mtime_ns == t  # finished shards were not redone
    got = all_tokens(resumed)
    for s in ref:
        assert np.array_equal(got[s], ref[s])
    assert resumed.manifest["shards"] == whole.manifest["shards"]


def test_corrupt_shard_is_found_before_use_and_rebuilt(tmp_path):
    from remoe.data.errors import DataError
    from remoe.data.streambuild import verify_store
    src = write_jsonl(tmp_path / "c.jsonl")
    b = prepare(tmp_path, [src])
    ref = all_tokens(b)
    root = b.store_root
    shard = sorted((root / "shards").glob("u*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0xFF
    shard.write_bytes(bytes(raw))  # same size: only a checksum finds it
    fresh = prepare(tmp_path, [src])  # start-up does not hash: it opens
    with pytest.raises(DataError, match="does not match its sha256"):
        all_tokens(fresh)
    problems = verify_store(tmp_path / "cache")
    assert len(problems) == 1 and shard.name in problems[0]
    again = prepare(tmp_path, [src])
    for s, arr in all_tokens(again).items():
        assert np.array_equal(arr, ref[s])


def test_start_up_does_not_read_the_sources(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "c.jsonl")
    prepare(tmp_path, [src])
    import remoe.data.docstream as ds
    def no_reading(*a, **k):
        raise AssertionError("the sources were read again")
    monkeypatch.setattr(ds, "read_user_source", no_reading)
    b = prepare(tmp_path, [src])
    assert b.split("train").num_tokens > 0
    os.utime(src, ns=(1, 1))  # a changed source is noticed (by its size and mtime)
    with pytest.raises(AssertionError, match="read again"):
        prepare(tmp_path, [src])


def test_workers_give_the_same_files(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl")
    one = prepare(tmp_path / "one", [src])
    two = prepare(tmp_path / "two", [src], workers=2)
    assert one.manifest["shards"] == two.manifest["shards"]


def test_dedup_and_plan_bounded_state(tmp_path):
    from remoe.data.dedup import SeenFingerprints
    seen = SeenFingerprints(tmp_path / "spill", max_memory_entries=16, merge_every=1000)
    texts = [f"doc {i}" for i in range(20000)]
    assert all(seen.add_if_new(t) for t in texts)
    assert len(list((tmp_path / "spill").glob("run*.u64"))) >= 1  # spilled to disk
    assert not any(seen.add_if_new(t) for t in texts[::97])


@pytest.mark.parametrize("bloom_bits", [64, 1 << 20])  # a saturated filter: every lookup on disk
def test_dedup_matches_an_exact_set_across_disk_runs(tmp_path, bloom_bits):
    """Spilled runs, the Bloom filter and the block reads give the answers of a Python set,
    duplicates inside a run, across runs and in the pending set alike; no run is mapped."""
    import random

    from remoe.data.dedup import SeenFingerprints
    rng = random.Random(0)
    seen = SeenFingerprints(tmp_path / "spill", max_memory_entries=16, bloom_bits=bloom_bits,
                            merge_every=4000)
    exact: set[str] = set()
    for i in range(30000):
        t = f"text {rng.randrange(20000)}" if i % 3 else f"unique {i}"
        assert seen.add_if_new(t) == (t not in exact), (i, t)
        exact.add(t)
    runs = sorted((tmp_path / "spill").glob("run*.u64"))
    assert len(runs) >= 3
    with open("/proc/self/maps") as f:
        assert not any(r.name in f.read() for r in runs)
    seen.close()
