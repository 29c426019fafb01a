"""Megatron indexed datasets as a source: train documents read in place, no copy."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_text  # noqa: E402
from test_data_shards import prepare, write_megatron  # noqa: E402


@pytest.fixture()
def megatron_store(tmp_path):
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer
    tok = train_tokenizer(iter([[make_text(d, i) for d in VOCAB for i in range(5)]]), 300)
    save_tokenizer(tok, tmp_path / "tok.json")
    rng = np.random.default_rng(1)
    # most documents end with EOS (id 0), as Megatron's --append-eod writes them; some do not
    docs = [[int(t) for t in rng.integers(1, 299, size=rng.integers(20, 60))] +
            ([0] if i % 7 else []) for i in range(80)]
    write_megatron(tmp_path / "mt", docs)
    b = prepare(tmp_path, [f"web={tmp_path / 'mt'}"], cfg={"tokenizer": str(tmp_path / "tok.json")})
    return tmp_path, docs, b


def test_megatron_train_documents_are_read_in_place(megatron_store):
    tmp_path, docs, b = megatron_store
    labels = np.fromfile(b.store_root / "plan.labels.u8", dtype=np.uint8)
    want = {}
    for k, s in enumerate(("train", "validation", "test")):
        # each split: its documents in dataset order, each ending with one EOS
        want[s] = [d if d[-1] == 0 else d + [0] for d, lab in zip(docs, labels) if lab == k]
        st = b.split(s)
        assert [list(st.document(i, with_eos=True)) for i in range(st.num_docs)] == want[s]
    flat = np.concatenate([np.asarray(d) for d in want["train"]])
    assert np.array_equal(b.split("train").read(0, flat.size), flat)
    # only held-out documents and train documents without EOS were copied into the shards
    copied = sum(len(d) + (d[-1] != 0) for d, lab in zip(docs, labels) if lab or d[-1] != 0)
    assert sum(v["bytes"] for v in b.manifest["shards"].values()) == 2 * copied
    assert list(b.manifest["external"]) == ["0"]
    # the sampler and per-domain evaluation read through it
    span = 17
    chunks = {tuple(flat[i * span:(i + 1) * span]) for i in range(flat.size // span)}
    batch = b.train_batches(seq_len=16, micro_batch=4, require_validation=False).batch(0)
    assert all(tuple(row) in chunks for row in batch.input_ids.numpy())
    assert len(list(b.eval_batches("validation", 8, batch_size=2))) >= 1


def test_a_changed_megatron_file_is_found_before_use(megatron_store):
    from remoe.data.errors import DataError
    from remoe.data.streambuild import verify_store
    tmp_path, _, b = megatron_store
    with open(tmp_path / "mt.bin", "ab") as f:
        f.write(b"\0\0")
    fresh = pickle.loads(pickle.dumps(b.split("train")))  # a new process opening the store
    with pytest.raises(DataError, match=r"mt\.bin \(read in place\) changed"):
        fresh.read(0, fresh.num_tokens)
    assert any("mt.bin (read in place)" in p for p in verify_store(tmp_path / "cache"))


def test_documents_of_a_megatron_store_are_its_decoded_tokens(megatron_store):
    tmp_path, docs, b = megatron_store
    for split in ("train", "validation", "test"):
        st, got = b.split(split), b.documents(split)
        assert len(got) == st.num_docs > 0
        for i in (0, st.num_docs - 1):
            assert got[i].text == b.decode(st.document(i)) and got[i].domain == "web"
    assert b.documents("validation", domain="other") == []
