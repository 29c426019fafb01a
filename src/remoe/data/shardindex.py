"""Each split's small index over the shards, written once after the last unit.

A split's tokens are a *virtual* array: domain by domain (sorted), the domain's sections of
every unit in unit order. Under ``index/``:

* ``S.segments.npy``    -- ``int64 [n, 4]``: virtual start, unit id, start inside the unit's
  ``.bin`` (tokens), length (tokens); one row per (domain, unit) section;
* ``S.doc_offsets.npy`` -- ``int64 [docs + 1]``: document ``i`` is virtual ``[o[i], o[i+1])``;
* ``S.doc_domains.npy`` -- ``int32 [docs]``: index into the domain list;
* ``heldout/S.jsonl``   -- validation and test only: the documents' text in the same order.

Memory: one unit's document lengths at a time (the arrays are written through a memmap).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from remoe.data._io import atomic_open, sha256_file
from remoe.data.documents import SPLITS
from remoe.data.shards import unit_name


def _section_positions(meta: dict[str, Any]) -> list[tuple[int, int, int, int, int, int, int]]:
    """Per section: label, domain, docs, tokens, first doc, first token, heldout (start, len)."""
    out, doc0, tok0 = [], 0, 0
    for label, dom, ndocs, ntok, h0, hlen in meta["sections"]:
        out.append((label, dom, ndocs, ntok, doc0, tok0, h0, hlen))
        doc0 += ndocs
        tok0 += ntok
    return out


def write_split_index(root: Path, shard_dir: Path, split: str, metas: list[dict[str, Any]],
                      domains: list[str]) -> dict[str, Any]:
    """Write the index files of ``split``; returns its manifest entry."""
    label = SPLITS.index(split)
    by_dom: dict[int, list[tuple[int, tuple]]] = {}
    for meta in metas:
        for pos in _section_positions(meta):
            if pos[0] == label:
                by_dom.setdefault(pos[1], []).append((int(meta["unit"]), pos))
    n_docs = sum(p[2] for secs in by_dom.values() for _, p in secs)
    index = root / "index"
    index.mkdir(parents=True, exist_ok=True)
    segments, ranges = [], {}
    tok_per_dom, docs_per_dom = {}, {}
    tmp_off = index / f".{split}.doc_offsets.npy.tmp"
    tmp_dom = index / f".{split}.doc_domains.npy.tmp"
    offsets = np.lib.format.open_memmap(tmp_off, mode="w+", dtype=np.int64, shape=(n_docs + 1,))
    doms = np.lib.format.open_memmap(tmp_dom, mode="w+", dtype=np.int32, shape=(n_docs,))
    offsets[0] = 0
    vstart = doc = 0
    for dom in sorted(by_dom):
        a = vstart
        for unit, (_, _, ndocs, ntok, doc0, tok0, _, _) in by_dom[dom]:
            lens = np.load(shard_dir / unit_name(unit, "lens.npy"), mmap_mode="r")
            offsets[doc + 1: doc + 1 + ndocs] = vstart + np.cumsum(lens[doc0: doc0 + ndocs])
            doms[doc: doc + ndocs] = dom
            segments.append((vstart, unit, tok0, ntok))
            vstart += ntok
            doc += ndocs
        ranges[domains[dom]] = [a, vstart]
        tok_per_dom[domains[dom]] = vstart - a
        docs_per_dom[domains[dom]] = sum(p[2] for _, p in by_dom[dom])
    offsets.flush()
    doms.flush()
    del offsets, doms
    files = {}
    for what, tmp in (("doc_offsets", tmp_off), ("doc_domains", tmp_dom)):
        final = index / f"{split}.{what}.npy"
        tmp.replace(final)
        files[f"index/{final.name}"] = {"sha256": sha256_file(final), "bytes": final.stat().st_size}
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 4)
    with atomic_open(index / f"{split}.segments.npy") as f:
        np.lib.format.write_array(f, seg, allow_pickle=False)
    p = index / f"{split}.segments.npy"
    files[f"index/{p.name}"] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    if split != "train":
        files.update(_write_heldout(root, shard_dir, split, by_dom))
    return {"num_tokens": int(vstart), "num_docs": int(n_docs), "tokens_per_domain": tok_per_dom,
            "docs_per_domain": docs_per_dom, "domain_ranges": ranges,
            "units": sorted({u for secs in by_dom.values() for u, _ in secs}), "files": files}


def _write_heldout(root: Path, shard_dir: Path, split: str,
                   by_dom: dict[int, list]) -> dict[str, Any]:
    path = root / "heldout" / f"{split}.jsonl"
    h = hashlib.sha256()
    with atomic_open(path) as out:
        for dom in sorted(by_dom):
            for unit, (*_, h0, hlen) in by_dom[dom]:
                if hlen:
                    with open(shard_dir / unit_name(unit, "heldout.jsonl"), "rb") as f:
                        f.seek(h0)
                        data = f.read(hlen)
                    out.write(data)
                    h.update(data)
    return {f"heldout/{path.name}": {"sha256": h.hexdigest(), "bytes": path.stat().st_size}}
