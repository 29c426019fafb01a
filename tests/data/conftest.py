"""Fixtures of the data pipeline tests: small synthetic corpora and a prepared bundle."""

from __future__ import annotations

import random
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[2] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import pytest  # noqa: E402

# distinct vocabularies per domain, so a chunk's text tells which domain it came from
VOCAB = {
    "alpha": "apple avocado almond apricot anchor arrow amber atlas".split(),
    "beta": "banana berry basil bread button bottle bridge butter".split(),
    "gamma": "cherry cocoa cedar candle copper castle cactus carrot".split(),
}


def make_text(domain: str, seed: int, n_words: int = 120) -> str:
    rng = random.Random(f"{domain}-{seed}")
    words = VOCAB[domain]
    lines = []
    for _ in range(n_words // 10):
        lines.append(" ".join(rng.choice(words) for _ in range(10)) + ".")
    return f"{domain} document {seed}\n" + "\n".join(lines) + "\n"


def write_txt_corpus(root: Path, docs_per_domain: int = 8, n_words: int = 120) -> Path:
    """``root/<domain>/doc_<i>.txt`` for the three synthetic domains."""
    for dom in VOCAB:
        d = root / dom
        d.mkdir(parents=True, exist_ok=True)
        for i in range(docs_per_domain):
            (d / f"doc_{i:02d}.txt").write_text(make_text(dom, i, n_words), encoding="utf-8")
    return root


@pytest.fixture
def txt_corpus(tmp_path: Path) -> Path:
    return write_txt_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory: pytest.TempPathFactory):
    """A bundle prepared once from the synthetic corpus (vocab 300, 10 docs per domain)."""
    from remoe.data import DataConfig, prepare_data

    base = tmp_path_factory.mktemp("bundle")
    src = write_txt_corpus(base / "corpus", docs_per_domain=10, n_words=300)
    cfg = DataConfig(sources=[str(src)], cache_dir=str(base / "cache"), vocab_size=300,
                     max_bytes_per_domain=1_000_000, val_fraction=0.1, test_fraction=0.1)
    return prepare_data(cfg, progress=False)
