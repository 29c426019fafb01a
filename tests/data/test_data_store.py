"""prepare_data: the packed token store, its manifest, caching and rebuilds."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from remoe.data import (SPLITS, DataConfig, load_documents, load_hf_tokenizer, load_prepared,
                        prepare_data)
from remoe.data import store as store_mod
from remoe.data import tokenizer as tok_mod
from remoe.data.cli import add_arguments, run


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
    build = _Counter(store_mod.build_split_store)
    train = _Counter(tok_mod.train_tokenizer)
    monkeypatch.setattr(store_mod, "build_split_store", build)
    monkeypatch.setattr(tok_mod, "train_tokenizer", train)
    return build, train


def _mtimes(cache):
    return {p: p.stat().st_mtime_ns for p in sorted(cache.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def test_store_layout_and_manifest(small_bundle):
    b = small_bundle
    m = json.loads((b.cache_dir / "manifest.json").read_text())
    assert m["format_version"] == 1
    assert m["tokenizer"]["sha256"] == m["tokens"]["tokenizer"]
    assert set(m["corpus"]["fingerprints"]) == {"alpha", "beta", "gamma"}
    assert b.domains == ["alpha", "beta", "gamma"]
    assert b.vocab_size == 300 and b.eos_id == 0 and b.tokenizer_path.name == "tokenizer.json"
    for s in SPLITS:
        st = b.split(s)
        assert st.dtype == np.uint16
        assert isinstance(st.tokens, np.memmap)
        entry = m["tokens"]["splits"][s]
        assert entry["num_tokens"] == st.num_tokens and entry["num_docs"] == st.num_docs
        assert set(st.docs_per_domain()) == {"alpha", "beta", "gamma"}  # every domain held out
        # each document ends with EOS and EOS appears nowhere else
        ends = st.doc_offsets[1:] - 1
        assert np.all(np.asarray(st.tokens)[ends] == b.eos_id)
        assert int((np.asarray(st.tokens) == b.eos_id).sum()) == st.num_docs
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


def test_rerun_reuses_everything(tmp_path, txt_corpus, counted):
    build, train = counted
    cfg = _cfg(txt_corpus, tmp_path / "cache")
    first = prepare_data(cfg, progress=False)
    assert (build.calls, train.calls) == (3, 1)
    before = _mtimes(tmp_path / "cache")
    second = prepare_data(cfg, progress=False)
    assert (build.calls, train.calls) == (3, 1)  # no re-tokenisation, no retraining
    assert _mtimes(tmp_path / "cache") == before  # nothing rewritten
    assert second.manifest == first.manifest
    # a different seq_len needs no rebuild either: chunking happens at load time
    assert len(second.split("train").chunks(16)) > len(second.split("train").chunks(32))
    assert build.calls == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_array_is_detected_and_rebuilt(tmp_path, txt_corpus, counted, caplog, damage):
    build, _ = counted
    cfg = _cfg(txt_corpus, tmp_path / "cache")
    good = prepare_data(cfg, progress=False)
    ref = np.asarray(good.split("train").tokens).copy()
    path = tmp_path / "cache" / "tokens" / "train.tokens.npy"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    else:
        path.unlink()
    with pytest.raises(ValueError, match="corrupt"):
        load_prepared(tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        fixed = prepare_data(cfg, progress=False)
    assert "train split" in caplog.text
    assert build.calls == 4  # only the damaged split was re-tokenised
    assert np.array_equal(np.asarray(fixed.split("train").tokens), ref)
    load_prepared(tmp_path / "cache")  # verifies cleanly again


def test_tokenizer_or_source_change_rebuilds(tmp_path, txt_corpus, counted, caplog):
    build, train = counted
    cache = tmp_path / "cache"
    a = prepare_data(_cfg(txt_corpus, cache), progress=False)
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        b = prepare_data(_cfg(txt_corpus, cache, vocab_size=320), progress=False)
    assert "retraining" in caplog.text and "tokenizer changed" in caplog.text
    assert (build.calls, train.calls) == (6, 2)
    assert b.vocab_size == 320
    assert b.manifest["tokenizer"]["sha256"] != a.manifest["tokenizer"]["sha256"]
    caplog.clear()
    # edit one source file: its domain's fingerprint changes
    (txt_corpus / "beta" / "doc_03.txt").write_text("a changed beta document\n")
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        c = prepare_data(_cfg(txt_corpus, cache, vocab_size=320), progress=False)
    assert "data sources changed (changed: beta)" in caplog.text
    assert (build.calls, train.calls) == (9, 3)
    fps_b, fps_c = b.manifest["corpus"]["fingerprints"], c.manifest["corpus"]["fingerprints"]
    assert fps_c["alpha"] == fps_b["alpha"] and fps_c["beta"] != fps_b["beta"]
    assert any(d.text == "a changed beta document\n" for s in SPLITS for d in c.documents(s))


def test_given_tokenizer_is_used(tmp_path, txt_corpus, small_bundle, counted):
    build, train = counted
    cfg = _cfg(txt_corpus, tmp_path / "cache", tokenizer=str(small_bundle.tokenizer_path))
    b = prepare_data(cfg, progress=False)
    assert train.calls == 0
    assert (b.tokenizer_path.read_bytes() == small_bundle.tokenizer_path.read_bytes())
    assert b.manifest["tokenizer"]["source"].startswith("loaded from")
    prepare_data(cfg, progress=False)
    assert build.calls == 3  # the second run reused the store
    hf = load_hf_tokenizer(b.cache_dir)
    assert hf.eos_token_id == b.eos_id


def test_identical_inputs_give_identical_bytes(tmp_path, txt_corpus):
    a = prepare_data(_cfg(txt_corpus, tmp_path / "a"), progress=False)
    b = prepare_data(_cfg(txt_corpus, tmp_path / "b"), progress=False)
    for rel in ["tokenizer.json", "corpus/train.jsonl"] + [
            f"tokens/{s}.{w}.npy" for s in SPLITS for w in store_mod.TOKEN_FILES]:
        assert (a.cache_dir / rel).read_bytes() == (b.cache_dir / rel).read_bytes(), rel


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
    assert not os.path.exists(tmp_path / "d" / "manifest.json")
