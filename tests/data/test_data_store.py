"""prepare_data: the sharded store's layout and manifest, checksums, reuse and rebuilds.

Covered elsewhere, so not repeated here (tests/data/test_data_shards.py): a rerun that reads
no source and re-encodes nothing (``test_start_up_does_not_read_the_sources``), a shard with
a flipped byte found by its sha256 and rebuilt (``test_corrupt_shard_is_found_before_use_and_
rebuilt``); nothing rewritten when other processes open the store
(tests/data/test_data_two_ranks.py).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from remoe.data import (SPLITS, DataConfig, load_documents, load_hf_tokenizer, load_prepared,
                        prepare_data)
from remoe.data import shards as shards_mod
from remoe.data import tokenizer as tok_mod
from remoe.data._io import sha256_file
from remoe.datacli import add_arguments, run
from remoe.data.errors import DataNotFoundError
from remoe.data.shardstore import ShardedStore, file_problem
from remoe.data.streambuild import STORE_DIR, STORE_FORMAT, all_files

SMALL_SHARD_BYTES = 4000  # the 24-document corpus (~19 KB) in several units


def _cfg(src, cache, **kw):
    base = dict(sources=[str(src)], cache_dir=str(cache), vocab_size=300,
                max_bytes_per_domain=1_000_000, val_fraction=0.1, test_fraction=0.1)
    base.update(kw)
    return DataConfig(**base)


class _Counter:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.fixture
def counted(monkeypatch):
    """(units encoded, tokenizers trained); one worker, so units are encoded in this process."""
    encode = _Counter(shards_mod.encode_unit)
    train = _Counter(tok_mod.train_tokenizer)
    monkeypatch.setattr(shards_mod, "encode_unit", encode)
    monkeypatch.setattr(tok_mod, "train_tokenizer", train)
    return encode, train


def _all_tokens(bundle):
    return {s: bundle.split(s).read(0, bundle.split(s).num_tokens) for s in SPLITS}


def test_store_layout_and_manifest(small_bundle):
    b = small_bundle
    store = b.cache_dir / STORE_DIR
    m = json.loads((store / "manifest.json").read_text())
    assert m == b.manifest
    assert m["format"] == STORE_FORMAT and m["key"].startswith(m["dir"]) and len(m["dir"]) == 16
    assert b.store_root == store / m["dir"]
    # nothing but the store (and the lock) is written in the cache directory
    assert not any((b.cache_dir / p).exists() for p in ("manifest.json", "corpus", "tokens"))
    assert b.tokenizer_path == b.store_root / "tokenizer.json"
    assert m["tokenizer"]["sha256"] == sha256_file(b.tokenizer_path)
    assert b.domains == m["domains"] == ["alpha", "beta", "gamma"]
    assert set(m["corpus"]["splits"]["train"]) == {"alpha", "beta", "gamma"}
    assert b.vocab_size == 300 and b.eos_id == 0 and m["dtype"] == "uint16"
    # every file the manifest lists is there with its recorded size and sha256
    files = all_files(m)
    assert {"tokenizer.json", "heldout/validation.jsonl", "heldout/test.jsonl"} <= set(files)
    assert {f"index/{s}.{w}.npy" for s in SPLITS for w in ("segments", "doc_offsets",
                                                           "doc_domains")} <= set(files)
    assert m["shards"] and all(name.endswith(".bin") for name in m["shards"])
    for rel, meta in files.items():
        assert file_problem(b.store_root / rel, meta, full=True) is None, rel
    assert json.loads((b.store_root / "plan.json").read_text())["domains"] == b.domains
    journal = (b.store_root / "shards" / "journal.jsonl").read_text().splitlines()
    assert len(journal) == len(m["shards"])
    for s in SPLITS:
        st = b.split(s)
        assert isinstance(st, ShardedStore) and st.dtype == np.uint16
        entry = m["tokens"]["splits"][s]
        assert entry["num_tokens"] == st.num_tokens == len(st.tokens)
        assert entry["num_docs"] == st.num_docs == len(st.doc_offsets) - 1
        assert st.doc_offsets[-1] == st.num_tokens
        assert set(st.docs_per_domain()) == {"alpha", "beta", "gamma"}  # every domain held out
        tokens = st.read(0, st.num_tokens)
        # the segment table (virtual start, unit, start in unit, length) tiles the split, and
        # its rows are the shards' memory-mapped tokens
        seg = np.load(b.store_root / "index" / f"{s}.segments.npy")
        assert seg.shape[1] == 4 and seg[0, 0] == 0
        assert np.array_equal(seg[1:, 0], np.cumsum(seg[:-1, 3]))
        assert int(seg[:, 3].sum()) == st.num_tokens
        for vstart, unit, off, n in seg.tolist():
            shard = st._shard(unit)
            assert isinstance(shard, np.memmap)
            assert np.array_equal(shard[off: off + n], tokens[vstart: vstart + n])
        # each document ends with EOS and EOS appears nowhere else
        ends = np.asarray(st.doc_offsets[1:]) - 1
        assert np.all(tokens[ends] == b.eos_id)
        assert int((tokens == b.eos_id).sum()) == st.num_docs
    assert "alpha" in b.summary() and "validation tokens" in b.summary()


def test_documents_round_trip_through_tokens(small_bundle):
    b = small_bundle
    for s in SPLITS:
        docs = b.documents(s)
        st = b.split(s)
        assert len(docs) == st.num_docs
        for i, d in enumerate(docs):
            assert b.decode(st.document(i)) == d.text
            assert st.domains[st.doc_domains[i]] == d.domain
    alpha_val = load_documents("validation", "alpha", cache_dir=b.cache_dir)
    assert alpha_val and all(d.domain == "alpha" for d in alpha_val)
    # held out at document level: no document key in two splits
    keys = [d.key for s in SPLITS for d in b.documents(s)]
    assert len(keys) == len(set(keys))


def test_chunks_never_cross_domains(small_bundle):
    b = small_bundle
    for s in SPLITS:
        st = b.split(s)
        for seq_len in (7, 64):
            table = st.chunks(seq_len)
            assert len(table) > 0
            for off, dom in zip(table.offsets, table.domain_ids):
                a, z = st.domain_ranges[b.domains[dom]]
                assert a <= off and off + seq_len + 1 <= z
            # decoded chunk text is a piece of its domain's documents (synthetic vocab per domain)
            batch = st.gather(table, np.arange(len(table)))
            assert batch.input_ids.shape == (len(table), seq_len + 1)
            for row, dom in zip(batch.input_ids[:20], batch.domain_ids[:20]):
                name = b.domains[int(dom)]
                joined = "<|endoftext|>".join(d.text for d in b.documents(s) if d.domain == name)
                assert b.decode(row) in joined


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_shard_is_detected_and_only_its_unit_rebuilt(tmp_path, txt_corpus, counted,
                                                             damage, caplog):
    encode, train = counted
    cfg = _cfg(txt_corpus, tmp_path / "cache")
    good = prepare_data(cfg, progress=False, shard_bytes=SMALL_SHARD_BYTES)
    units = encode.calls
    assert units >= 3 and units == len(good.manifest["shards"])
    ref, ref_manifest = _all_tokens(good), good.manifest
    shard = good.store_root / "shards" / "u000001.bin"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        shard.unlink()
    with pytest.raises(DataNotFoundError, match="no complete data cache"):
        load_prepared(tmp_path / "cache")
    fixed = prepare_data(cfg, progress=False, shard_bytes=SMALL_SHARD_BYTES)
    assert "shards/u000001.bin: u000001.bin " in caplog.text  # the rebuild names the file
    assert encode.calls == units + 1  # only the damaged unit was re-tokenised
    assert train.calls == 1  # the tokenizer was kept
    assert fixed.manifest == ref_manifest
    for s, arr in _all_tokens(fixed).items():
        assert np.array_equal(arr, ref[s])
    load_prepared(tmp_path / "cache")  # verifies cleanly again


def test_tokenizer_or_source_change_rebuilds(tmp_path, txt_corpus, counted, caplog):
    encode, train = counted
    cache = tmp_path / "cache"
    a = prepare_data(_cfg(txt_corpus, cache), progress=False)
    a_manifest, a_root = a.manifest, a.store_root
    assert (encode.calls, train.calls) == (1, 1)
    assert not [r for r in caplog.records if "again" in r.getMessage()]  # a first build
    b = prepare_data(_cfg(txt_corpus, cache, vocab_size=320), progress=False)
    assert "data.vocab_size changed (300 -> 320); building the sharded store again" in caplog.text
    assert (encode.calls, train.calls) == (2, 2)  # retrained and re-tokenised
    assert b.vocab_size == 320
    assert b.manifest["tokenizer"]["sha256"] != a_manifest["tokenizer"]["sha256"]
    assert b.manifest["key"] != a_manifest["key"]
    # the other settings' store is removed once the new one is finished
    assert not a_root.exists()
    assert [p.name for p in (cache / STORE_DIR).iterdir() if p.is_dir()] == [b.manifest["dir"]]
    # edit one source file: its size and mtime change the key
    old_text = (txt_corpus / "beta" / "doc_03.txt").read_text()
    (txt_corpus / "beta" / "doc_03.txt").write_text("a changed beta document\n")
    c = prepare_data(_cfg(txt_corpus, cache, vocab_size=320), progress=False)
    assert f"source file {txt_corpus / 'beta' / 'doc_03.txt'} changed" in caplog.text
    assert (encode.calls, train.calls) == (3, 3)
    assert c.manifest["key"] != b.manifest["key"]
    texts = [d.text for s in SPLITS for d in c.documents(s)]
    assert "a changed beta document\n" in texts and old_text not in texts


def test_given_tokenizer_is_used(tmp_path, txt_corpus, small_bundle, counted):
    encode, train = counted
    cfg = _cfg(txt_corpus, tmp_path / "cache", tokenizer=str(small_bundle.tokenizer_path))
    b = prepare_data(cfg, progress=False)
    assert train.calls == 0 and encode.calls == 1
    assert b.tokenizer_path.read_bytes() == small_bundle.tokenizer_path.read_bytes()
    assert b.manifest["tokenizer"]["source"].startswith("loaded from")
    prepare_data(cfg, progress=False)
    assert encode.calls == 1  # the second run reused the store
    hf = load_hf_tokenizer(b.cache_dir)  # the data cache directory names its tokenizer
    assert hf.eos_token_id == b.eos_id
    assert len(hf) == b.vocab_size


def test_identical_inputs_give_identical_bytes(tmp_path, txt_corpus):
    a = prepare_data(_cfg(txt_corpus, tmp_path / "a"), progress=False,
                     shard_bytes=SMALL_SHARD_BYTES)
    b = prepare_data(_cfg(txt_corpus, tmp_path / "b"), progress=False,
                     shard_bytes=SMALL_SHARD_BYTES)
    assert a.manifest == b.manifest
    store_a, store_b = a.cache_dir / STORE_DIR, b.cache_dir / STORE_DIR
    files = sorted(p.relative_to(store_a) for p in store_a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(store_b) for p in store_b.rglob("*") if p.is_file())
    assert {f"{a.manifest['dir']}/{rel}" for rel in all_files(a.manifest)} <= set(map(str, files))
    for rel in files:
        assert (store_a / rel).read_bytes() == (store_b / rel).read_bytes(), rel


def test_cli_run(tmp_path, txt_corpus, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--source", str(txt_corpus / "alpha"), "--source",
                              f"bee={txt_corpus / 'beta'}", "--cache-dir", str(tmp_path / "c"),
                              "--vocab-size", "290", "--quiet"])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "bee" in out and "total" in out
    assert load_prepared(tmp_path / "c").domains == ["alpha", "bee"]
    bad = parser.parse_args(["--vocab-size", "10", "--cache-dir", str(tmp_path / "d")])
    assert run(bad) == 2
    assert "data.vocab_size=10 must be >= 256" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "d")  # nothing built, not even the directory


@pytest.mark.parametrize("setting", ["explicit", "default cap"])
def test_tokenizer_sample_is_bounded(tmp_path, txt_corpus, monkeypatch, setting):
    """The BPE trainer sees a deterministic per-domain sample of about the cap, set or not."""
    from remoe.data import streambuild
    seen: list[int] = []
    real = tok_mod.train_tokenizer

    def spy(batches, *a, **k):
        batches = [list(b) for b in batches]
        seen.append(sum(len(t.encode()) for b in batches for t in b))
        return real(iter(batches), *a, **k)

    monkeypatch.setattr(tok_mod, "train_tokenizer", spy)
    whole = prepare_data(_cfg(txt_corpus, tmp_path / "whole"), progress=False)
    total = sum(v["bytes"] for v in whole.manifest["corpus"]["splits"]["train"].values())
    assert seen == [total]  # below the cap: the whole train split
    cap = total // 3
    if setting == "explicit":
        kw = {"tokenizer_train_bytes": cap}
    else:
        monkeypatch.setattr(streambuild, "DEFAULT_TOKENIZER_TRAIN_BYTES", cap)
        kw = {}
    a = prepare_data(_cfg(txt_corpus, tmp_path / "a", **kw), progress=False)
    b = prepare_data(_cfg(txt_corpus, tmp_path / "b", **kw), progress=False)
    assert 0 < seen[1] < total / 2 and seen[1] == seen[2]
    assert a.manifest["tokenizer"]["sha256"] == b.manifest["tokenizer"]["sha256"]


def test_eval_opens_an_existing_cache_without_preparing_it(small_bundle, monkeypatch, capsys):
    """`remoe eval` on a run whose cache exists opens it (it looked for a manifest where the
    store no longer keeps it, said 'no prepared data cache' and prepared it again)."""
    import remoe.data
    from remoe.data.pipeline import has_prepared
    from remoe.eval.cli import _DataCache

    def no_build(*a, **k):
        raise AssertionError("prepared again")

    monkeypatch.setattr(remoe.data, "prepare_data", no_build)
    cache = small_bundle.cache_dir
    assert has_prepared(cache) and not has_prepared(cache / "nothing")
    got = _DataCache().get(None, {"data": {"cache_dir": str(cache)}}, None)
    assert got.manifest["key"] == small_bundle.manifest["key"]
    assert "no prepared data cache" not in capsys.readouterr().err
