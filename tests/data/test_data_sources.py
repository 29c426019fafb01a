"""Reading user corpora (.txt, Pile .jsonl / .jsonl.zst) and the built-in sources."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import zstandard

from remoe.data import builtin
from remoe.data.corpus import parse_source
from remoe.data.docstream import stream_documents
from remoe.data.plan import build_plan
from remoe.data.userdata import read_jsonl, read_user_source

RECORDS = [
    {"text": "def f():\n    return 1\n", "meta": {"pile_set_name": "Github"}},
    {"text": "Once upon a time.", "meta": {"pile_set_name": "Books3"}},
    {"text": "no meta at all"},
    {"text": "meta without a set name", "meta": {"other": 1}},
    {"text": "carriage\r\nreturns\r\n", "meta": {"pile_set_name": "Github"}},
]


def _stream(sources, max_bytes, tmp_path, found=None):
    """The kept documents of ``sources`` (the streaming path every build reads)."""
    return list(stream_documents(list(sources), max_bytes, tmp_path / "spill", found))


def _by_domain(docs):
    out = {}
    for d in docs:
        out.setdefault(d.domain, []).append(d)
    return out


def _write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    data = ("\n".join(lines) + "\n").encode("utf-8")
    if path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    elif path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", ["shard.jsonl", "shard.jsonl.zst", "shard.jsonl.gz"])
def test_pile_jsonl_domains(tmp_path, name, caplog):
    path = _write_jsonl(tmp_path / name, RECORDS, extra_lines=["{not json", ""])
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        docs = list(read_jsonl(path))
    assert [d.domain for d in docs] == ["Github", "Books3", "unknown", "unknown", "Github"]
    assert docs[0].text == RECORDS[0]["text"]
    assert docs[4].text == "carriage\nreturns\n"  # newlines normalised
    assert [d.key for d in docs] == [f"{name}:{i}" for i in (1, 2, 3, 4, 5)]
    assert "malformed" in caplog.text and f"{name}:6" in caplog.text


def test_zst_multi_frame(tmp_path):
    c = zstandard.ZstdCompressor()
    frames = b"".join(c.compress((json.dumps(r) + "\n").encode()) for r in RECORDS)
    (tmp_path / "multi.jsonl.zst").write_bytes(frames)
    docs = list(read_jsonl(tmp_path / "multi.jsonl.zst"))
    assert [d.text for d in docs][:2] == [RECORDS[0]["text"], RECORDS[1]["text"]]
    assert len(docs) == len(RECORDS)


def test_txt_directory_domains_and_override(tmp_path):
    root = tmp_path / "mydata"
    (root / "poems").mkdir(parents=True)
    (root / "recipes").mkdir()
    (root / "poems" / "b.txt").write_text("roses are red\n")
    (root / "poems" / "a.txt").write_text("violets are blue\n")
    (root / "recipes" / "soup.txt").write_bytes("caf\xe9 soup\n".encode("latin-1"))
    (root / "recipes" / "notes.md").write_text("ignored: not a data file\n")
    _write_jsonl(root / "pile.jsonl", RECORDS[:2])

    docs = list(read_user_source(root))
    assert [(d.domain, d.key) for d in docs] == [
        ("Github", "mydata/pile.jsonl:1"),
        ("Books3", "mydata/pile.jsonl:2"),
        ("poems", "mydata/poems/a.txt"),
        ("poems", "mydata/poems/b.txt"),
        ("recipes", "mydata/recipes/soup.txt"),
    ]
    assert docs[-1].text == "café soup\n"  # Latin-1 fallback

    spec = parse_source(f"verse={root / 'poems'}")
    assert spec.domain == "verse" and spec.path == str(root / "poems")
    named = _stream([f"verse={root / 'poems'}"], 10_000, tmp_path)
    assert {d.domain for d in named} == {"verse"}
    assert [d.text for d in named] == ["violets are blue\n", "roses are red\n"]


def test_budget_dedup_and_determinism(tmp_path):
    d = tmp_path / "dom"
    d.mkdir()
    for i in range(20):
        (d / f"{i:02d}.txt").write_text(f"document number {i} " * 10 + "\n")  # ~220 bytes
    (d / "dup.txt").write_text((d / "03.txt").read_text())
    (d / "empty.txt").write_text("  \n\n")
    full = _stream([str(d)], 1_000_000, tmp_path)
    assert len(full) == 20  # duplicate and blank file dropped
    assert "dom/dup.txt" not in {x.key for x in full}  # the first occurrence wins
    small = _stream([str(d)], 1000, tmp_path)
    nbytes = sum(x.num_bytes for x in small)
    assert 0 < nbytes <= 1000 and len(small) == 5  # 181-byte docs
    again = _stream([str(d)], 1000, tmp_path)
    assert [(x.key, x.text) for x in again] == [(x.key, x.text) for x in small]
    assert [x.key for x in full[:5]] == [x.key for x in small]


def test_bad_source_specs(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in domain"):
        parse_source("builtin:poetry")
    with pytest.raises(FileNotFoundError):
        _stream([str(tmp_path / "missing")], 1000, tmp_path)


def test_missing_builtin_source_warns_with_install_command(monkeypatch, caplog, txt_corpus,
                                                           tmp_path):
    monkeypatch.setattr(builtin, "foldoc_paths", lambda: None)
    found = {}
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        docs = _stream(["builtin:encyclopedia", str(txt_corpus)], 5000, tmp_path, found)
    assert "apt-get install dict-foldoc" in caplog.text
    assert found["missing"] == ["foldoc"]
    assert sorted(_by_domain(docs)) == ["alpha", "beta", "gamma"]
    found = {}
    sources = ["builtin:encyclopedia"]
    with pytest.raises(FileNotFoundError, match="apt-get install dict-foldoc"):
        build_plan(stream_documents(sources, 5000, tmp_path / "spill", found), tmp_path,
                   0.1, 0.1, sources, found)


def test_dictd_number_decoding():
    assert builtin.dictd_number("A") == 0
    assert builtin.dictd_number("B") == 1
    assert builtin.dictd_number("BA") == 64
    assert builtin.dictd_number("Gb9L") == ((6 * 64 + 27) * 64 + 61) * 64 + 11


def test_builtin_corpus_small_budget_is_deterministic(tmp_path):
    """Each installed built-in domain yields documents within budget, identically twice."""
    found = {}
    c1 = _stream(["builtin"], 40_000, tmp_path, found)
    c2 = _stream(["builtin"], 40_000, tmp_path)
    assert [(d.key, d.text) for d in c1] == [(d.key, d.text) for d in c2]
    docs = _by_domain(c1)
    expected = {s.domain for s in builtin.BUILTIN_SOURCES if s.name in found["used"]}
    assert set(docs) == expected and expected
    for dom, ds in docs.items():
        assert 0 < sum(d.num_bytes for d in ds) <= 40_000, dom
    if "foldoc" in found["used"]:
        text = "\n".join(d.text for d in docs["encyclopedia"])
        assert "00-database" not in text
    if "cpython-stdlib" in found["used"]:
        assert all(d.key.startswith("cpython/") and d.key.endswith(".py") for d in docs["code"])
        assert not any("/test/" in d.key or "site-packages" in d.key for d in docs["code"])
