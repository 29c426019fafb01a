"""Reading user corpora (.txt, Pile .jsonl / .jsonl.zst) and the built-in sources."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import zstandard

from remoe.data import builtin
from remoe.data.corpus import collect_corpus, parse_source
from remoe.data.userdata import read_jsonl, read_user_source

RECORDS = [
    {"text": "def f():\n    return 1\n", "meta": {"pile_set_name": "Github"}},
    {"text": "Once upon a time.", "meta": {"pile_set_name": "Books3"}},
    {"text": "no meta at all"},
    {"text": "meta without a set name", "meta": {"other": 1}},
    {"text": "carriage\r\nreturns\r\n", "meta": {"pile_set_name": "Github"}},
]


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
    named = collect_corpus([f"verse={root / 'poems'}"], 10_000)
    assert named.domains == ["verse"]
    assert [d.text for d in named.docs["verse"]] == ["violets are blue\n", "roses are red\n"]


def test_budget_dedup_and_determinism(tmp_path):
    d = tmp_path / "dom"
    d.mkdir()
    for i in range(20):
        (d / f"{i:02d}.txt").write_text(f"document number {i} " * 10 + "\n")  # ~220 bytes
    (d / "dup.txt").write_text((d / "03.txt").read_text())
    (d / "empty.txt").write_text("  \n\n")
    full = collect_corpus([str(d)], 1_000_000)
    assert len(full.docs["dom"]) == 20  # duplicate and blank file dropped
    small = collect_corpus([str(d)], 1000)
    nbytes = small.num_bytes()["dom"]
    assert 0 < nbytes <= 1000 and len(small.docs["dom"]) == 5  # 181-byte docs
    again = collect_corpus([str(d)], 1000)
    assert again.fingerprints() == small.fingerprints()
    assert full.fingerprints() != small.fingerprints()


def test_bad_source_specs(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in domain"):
        parse_source("builtin:poetry")
    with pytest.raises(FileNotFoundError):
        collect_corpus([str(tmp_path / "missing")], 1000)


def test_missing_builtin_source_warns_with_install_command(monkeypatch, caplog, txt_corpus):
    monkeypatch.setattr(builtin, "foldoc_paths", lambda: None)
    with caplog.at_level(logging.WARNING, logger="remoe.data"):
        c = collect_corpus(["builtin:encyclopedia", str(txt_corpus)], 5000)
    assert "apt-get install dict-foldoc" in caplog.text
    assert c.sources_missing == ["foldoc"]
    assert "encyclopedia" not in c.domains and c.domains == ["alpha", "beta", "gamma"]
    with pytest.raises(FileNotFoundError, match="apt-get install dict-foldoc"):
        collect_corpus(["builtin:encyclopedia"], 5000)


def test_dictd_number_decoding():
    assert builtin.dictd_number("A") == 0
    assert builtin.dictd_number("B") == 1
    assert builtin.dictd_number("BA") == 64
    assert builtin.dictd_number("Gb9L") == ((6 * 64 + 27) * 64 + 61) * 64 + 11


def test_builtin_corpus_small_budget_is_deterministic():
    """Each installed built-in domain yields documents within budget, identically twice."""
    c1 = collect_corpus(["builtin"], 40_000)
    c2 = collect_corpus(["builtin"], 40_000)
    assert c1.fingerprints() == c2.fingerprints()
    expected = {s.domain for s in builtin.BUILTIN_SOURCES if s.name in c1.sources_used}
    assert set(c1.domains) == expected and expected
    for dom, n in c1.num_bytes().items():
        assert 0 < n <= 40_000, dom
    if "foldoc" in c1.sources_used:
        text = "\n".join(d.text for d in c1.docs["encyclopedia"])
        assert "00-database" not in text
    if "cpython-stdlib" in c1.sources_used:
        assert all(d.key.startswith("cpython/") and d.key.endswith(".py")
                   for d in c1.docs["code"])
        assert not any("/test/" in d.key or "site-packages" in d.key for d in c1.docs["code"])
