"""Document-level, hash-based train/validation/test splits."""

from __future__ import annotations

import random

from remoe.data import SPLITS, Document, assign_splits, split_unit


def _docs(n_per_domain: dict[str, int]) -> dict[str, list[Document]]:
    return {dom: [Document(dom, f"{dom}/doc{i:04d}", f"text {dom} {i}") for i in range(n)]
            for dom, n in n_per_domain.items()}


def _keys(splits):
    return {s: [(d.domain, d.key) for d in docs] for s, docs in splits.items()}


def test_splits_are_deterministic_disjoint_and_complete():
    docs = _docs({"code": 400, "prose": 50, "tiny": 3, "pair": 2})
    a = assign_splits(docs, 0.05, 0.05)
    shuffled = {dom: random.Random(1).sample(ds, len(ds)) for dom, ds in docs.items()}
    b = assign_splits(shuffled, 0.05, 0.05)
    assert _keys(a) == _keys(b)  # independent of input order
    seen = [k for s in SPLITS for k in _keys(a)[s]]
    assert len(seen) == len(set(seen)) == sum(len(v) for v in docs.values())
    # every domain with >= 3 documents is represented in validation and test
    for s in ("validation", "test"):
        doms = {d.domain for d in a[s]}
        assert {"code", "prose", "tiny"} <= doms
        assert all(d.domain == d.key.split("/")[0] for d in a[s])  # labels kept
    tiny = {s: [d.key for d in a[s] if d.domain == "tiny"] for s in SPLITS}
    assert [len(tiny[s]) for s in SPLITS] == [1, 1, 1]
    # roughly the requested fractions on a large domain
    n_val = sum(d.domain == "code" for d in a["validation"])
    assert 8 <= n_val <= 40
    # each split is ordered by (domain, key)
    for s in SPLITS:
        assert _keys(a)[s] == sorted(_keys(a)[s])


def test_split_of_a_document_does_not_depend_on_other_documents():
    docs = _docs({"code": 300})
    a = assign_splits(docs, 0.05, 0.05)
    more = {"code": docs["code"] + [Document("code", f"code/new{i}", "x") for i in range(100)],
            "other": [Document("other", f"o{i}", "y") for i in range(10)]}
    b = assign_splits(more, 0.05, 0.05)
    where_a = {d.key: s for s in SPLITS for d in a[s]}
    where_b = {d.key: s for s in SPLITS for d in b[s]}
    assert all(where_b[k] == where_a[k] for k in where_a)
    # and the decision is the documented hash threshold
    for k, s in where_a.items():
        u = split_unit("code", k)
        assert s == ("validation" if u < 0.05 else "test" if u < 0.10 else "train")


def test_zero_fraction_means_no_held_out_docs():
    a = assign_splits(_docs({"code": 50}), 0.0, 0.1)
    assert a["validation"] == []
    assert a["test"] and a["train"]
