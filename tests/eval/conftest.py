"""Fixtures of the evaluation tests: a tiny tokenizer, micro models, synthetic held-out docs."""

from __future__ import annotations

import random
import socket

import pytest

# per-domain vocabularies; every document also has its own words, so a document's true
# continuation is recognisable from its context
VOCAB = {
    "alpha": "apple avocado almond apricot anchor arrow amber atlas".split(),
    "beta": "banana berry basil bread button bottle bridge butter".split(),
    "gamma": "cherry cocoa cedar candle copper castle cactus carrot".split(),
}


def make_doc(domain: str, i: int, n_words: int = 160) -> str:
    rng = random.Random(f"{domain}/{i}")
    words = VOCAB[domain] + [f"{domain}{i}word{k}" for k in range(4)]
    lines = []
    for _ in range(n_words // 8):
        lines.append(" ".join(rng.choice(words) for _ in range(8)) + ".")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def held_out_docs() -> dict[str, list[tuple[str, str]]]:
    """``{domain: [(key, text)]}``: 3 domains x 4 documents."""
    return {d: [(f"doc{i}", make_doc(d, i)) for i in range(4)] for d in VOCAB}


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, held_out_docs) -> str:
    """A byte-level BPE tokenizer.json (vocab 300) trained with HF tokenizers."""
    from remoe.data.tokenizer import save_tokenizer, train_tokenizer

    texts = [t for docs in held_out_docs.values() for _, t in docs]
    tok = train_tokenizer([texts], vocab_size=300)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(tok, path)
    return str(path)


@pytest.fixture(scope="session")
def make_micro_model():
    """``make_micro_model(seed=0, **config overrides)``: a random micro ReMoE (vocab 320)."""

    def make(seed: int = 0, **overrides):
        import torch

        from remoe import ReMoEConfig, ReMoEForCausalLM

        torch.manual_seed(seed)
        cfg = ReMoEConfig.from_preset("micro", **{"vocab_size": 320, "num_experts": 4,
                                                  **overrides})
        return ReMoEForCausalLM(cfg).eval()

    return make


@pytest.fixture
def no_network(monkeypatch):
    """Fail (and record) any attempt to open a network connection."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted during an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


@pytest.fixture
def tiny_run(tmp_path, held_out_docs, make_micro_model):
    """A saved run directory ``runs/tiny``: a micro model in ``final/`` with its tokenizer, and
    the data section of a small corpus (three domains of ten documents, 30% held out)."""
    import shutil

    import yaml

    from remoe.data import DataConfig, prepare_data

    sources = []
    for dom, docs in held_out_docs.items():
        d = tmp_path / "corpus" / dom
        d.mkdir(parents=True)
        base = docs[0][1].split()
        for i in range(10):
            rng = random.Random(f"{dom}{i}")
            (d / f"doc{i}.txt").write_text(" ".join(rng.choice(base) for _ in range(150)))
        sources.append(f"{dom}={d}")
    data = DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), vocab_size=300,
                      test_fraction=0.3)
    bundle = prepare_data(data, progress=False)
    run = tmp_path / "runs" / "tiny"
    make_micro_model(seed=3).save_pretrained(run / "final")
    shutil.copy(bundle.tokenizer_path, run / "final" / "tokenizer.json")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": data.to_dict(),
                                                     "train": {"seq_len": 32}}))
    return run
