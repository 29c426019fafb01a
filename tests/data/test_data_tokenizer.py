"""Tokenizer training determinism, loading (tokenizer.json, GPT-2 files), HF wrapping, config."""

from __future__ import annotations

import json
import logging
import random

import pytest
from tokenizers import pre_tokenizers

from remoe.data import (EOS_TOKEN, DataConfig, load_hf_tokenizer, load_tokenizer, save_tokenizer,
                        train_tokenizer)
from remoe.data.tokenizer import batched_texts
from remoe.errors import ConfigError

_rng = random.Random(0)
WORDS = ["".join(_rng.choice("abcdefghijklmnoprstuvwy") for _ in range(_rng.randint(2, 9)))
         for _ in range(400)]


def _text(seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(40))


TEXTS = [_text(i) for i in range(18)] + [
    "def main():\n    print('héllo wörld')\n    return 0\n",
]


def _train(vocab=400):
    return train_tokenizer(batched_texts(TEXTS, batch_bytes=2000), vocab)


def test_training_is_deterministic(tmp_path):
    a, b = _train(), _train()
    assert a.to_str() == b.to_str()
    sha_a = save_tokenizer(a, tmp_path / "a.json")
    sha_b = save_tokenizer(b, tmp_path / "b.json")
    assert sha_a == sha_b
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert _train(300).to_str() != a.to_str()


def test_trained_tokenizer_properties():
    tok = _train(400)
    assert tok.get_vocab_size() == 400
    assert tok.token_to_id(EOS_TOKEN) == 0
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        assert tok.decode(ids) == t  # byte-level: lossless, no prefix space
    # EOS in text is one special token and never produced by ordinary text
    assert tok.encode("a<|endoftext|>b").ids.count(0) == 1
    assert 0 not in tok.encode(TEXTS[0]).ids
    assert len(tok.encode(TEXTS[0]).ids) < 0.8 * len(TEXTS[0].encode())  # merges were learned


def _gpt2_files(directory, with_eos=True):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in ("th", "the", "Ġthe"):
        vocab[tok] = len(vocab)
    if with_eos:
        vocab[EOS_TOKEN] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nt h\nth e\nĠ the\n")
    return vocab


def test_load_gpt2_vocab_and_merges(tmp_path):
    vocab = _gpt2_files(tmp_path / "gpt2")
    for path in (tmp_path / "gpt2", tmp_path / "gpt2" / "vocab.json"):
        tok = load_tokenizer(path)
        ids = tok.encode("the the").ids
        assert ids == [vocab["the"], vocab["Ġthe"]]
        assert tok.decode(ids) == "the the"
        assert tok.token_to_id(EOS_TOKEN) == vocab[EOS_TOKEN]
        assert tok.encode("x<|endoftext|>").ids[-1] == vocab[EOS_TOKEN]


def test_gpt2_vocab_without_eos_gets_one(tmp_path, caplog):
    vocab = _gpt2_files(tmp_path / "noeos", with_eos=False)
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        tok = load_tokenizer(tmp_path / "noeos")
    assert tok.token_to_id(EOS_TOKEN) == len(vocab)
    assert "no end-of-text token" in caplog.text


def test_load_tokenizer_json_and_hf_wrapper(tmp_path):
    tok = _train(350)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)
    assert again.to_str() == tok.to_str()
    hf = load_hf_tokenizer(tmp_path)
    assert hf.eos_token == hf.bos_token == hf.pad_token == EOS_TOKEN
    assert hf.eos_token_id == 0
    text = "apple  banana\n\n  cherry!"
    ids = hf(text)["input_ids"]
    assert ids == tok.encode(text).ids  # no BOS/EOS inserted
    assert hf.decode(ids) == text
    assert len(hf) == 350
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nowhere")


def test_config_validation_messages(tmp_path):
    DataConfig().validate()
    with pytest.raises(ConfigError) as e:
        DataConfig(vocab_size=10).validate()
    assert str(e.value) == "data.vocab_size=10 must be >= 256"
    cases = [
        (dict(sources=[]), "data.sources"),
        (dict(sources="builtin"), "data.sources"),
        (dict(sources=["builtin:poetry"]), "data.sources[0]"),
        (dict(sources=["builtin", str(tmp_path / "nope")]), "data.sources[1]"),
        (dict(max_bytes_per_domain=0), "data.max_bytes_per_domain=0"),
        (dict(val_fraction=0.7), "data.val_fraction=0.7"),
        (dict(test_fraction=-0.1), "data.test_fraction=-0.1"),
        (dict(seed=-1), "data.seed=-1"),
        (dict(vocab_size=512.0), "data.vocab_size=512.0"),
        (dict(tokenizer=str(tmp_path / "tok.json")), "data.tokenizer="),
    ]
    for kwargs, prefix in cases:
        with pytest.raises(ConfigError) as e:
            DataConfig(**kwargs).validate()
        msg = str(e.value)
        assert msg.startswith(prefix) and "\n" not in msg, msg
    with pytest.raises(ConfigError, match="data.vocab is not a data option"):
        DataConfig.from_dict({"vocab": 3})
    assert DataConfig.from_dict({"sources": "builtin:code"}).sources == ["builtin:code"]
