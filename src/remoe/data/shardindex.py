"""Each split's small index over the shards, written once after the last unit.

A split's tokens are a *virtual* array: domain by domain (sorted), the domain's sections of
every unit in unit order. Under ``index/``:

* ``S.segments.npy``    -- ``int64 [n, 4]``: virtual start, unit id, start inside the unit's
  ``.bin`` (tokens), length (tokens); one row per (domain, unit) section, or per part of it
  between in-place runs; an in-place run's row has unit ``-1 - n`` for Megatron dataset ``n``
  and its start in that dataset's ``.bin``;
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

from remoe.data._io import sha256_file
from remoe.fileio import atomic_open
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


def _by_domain(metas: list[dict[str, Any]], label: int) -> dict[int, dict[int, list]]:
    """``{domain: {unit: [section position or None, in-place runs]}}`` of one split."""
    by_dom: dict[int, dict[int, list]] = {}
    for meta in metas:
        unit = int(meta["unit"])
        for pos in _section_positions(meta):
            if pos[0] == label:
                by_dom.setdefault(pos[1], {}).setdefault(unit, [None, []])[0] = pos
        for run in meta.get("inplace", ()):
            if run[0] == label:
                by_dom.setdefault(run[1], {}).setdefault(unit, [None, []])[1].append(run)
    return by_dom


def write_split_index(root: Path, shard_dir: Path, split: str, metas: list[dict[str, Any]],
                      domains: list[str], external: list[Path] = ()) -> dict[str, Any]:
    """Write the index files of ``split``; returns its manifest entry. ``external``: the
    Megatron datasets in-place runs refer to (by number); a segment of one has unit ``-1 - n``."""
    from remoe.data.megatron import MegatronDataset

    label = SPLITS.index(split)
    by_dom = _by_domain(metas, label)
    n_docs = sum((pos[2] if pos else 0) + sum(r[5] - r[4] for r in runs)
                 for units in by_dom.values() for pos, runs in units.values())
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
    datasets: dict[int, Any] = {}

    def emit(lens: np.ndarray, dom: int, segment: tuple[int, int, int]) -> None:
        nonlocal vstart, doc
        n = lens.shape[0]
        offsets[doc + 1: doc + 1 + n] = vstart + np.cumsum(lens)
        doms[doc: doc + n] = dom
        segments.append((vstart, *segment))
        vstart += segment[2]
        doc += n

    for dom in sorted(by_dom):
        a, d0 = vstart, doc
        for unit, (pos, runs) in sorted(by_dom[dom].items()):
            lens = np.zeros(0, np.int64) if pos is None else np.load(
                shard_dir / unit_name(unit, "lens.npy"), mmap_mode="r")
            ndocs, doc0, tok0 = (0, 0, 0) if pos is None else (pos[2], pos[4], pos[5])
            done = 0
            for run in [*runs, None]:  # copied documents and in-place runs in stream order
                upto = ndocs if run is None else run[2]
                if upto > done:
                    part = np.asarray(lens[doc0 + done: doc0 + upto], dtype=np.int64)
                    skip = int(np.sum(lens[doc0: doc0 + done], dtype=np.int64))
                    emit(part, dom, (unit, tok0 + skip, int(part.sum())))
                    done = upto
                if run is not None:
                    ds = datasets.get(run[3]) or datasets.setdefault(
                        run[3], MegatronDataset(external[run[3]]))
                    emit(ds.doc_lengths(run[4], run[5]), dom, (-1 - run[3], run[6], run[7]))
        ranges[domains[dom]] = [a, vstart]
        tok_per_dom[domains[dom]] = vstart - a
        docs_per_dom[domains[dom]] = doc - d0
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
    out = {"num_tokens": int(vstart), "num_docs": int(n_docs), "tokens_per_domain": tok_per_dom,
           "docs_per_domain": docs_per_dom, "domain_ranges": ranges,
           "units": sorted({u for units in by_dom.values() for u, (pos, _) in units.items()
                            if pos is not None}), "files": files}
    if datasets:
        out["external"] = sorted(datasets)
    return out


def _write_heldout(root: Path, shard_dir: Path, split: str,
                   by_dom: dict[int, dict[int, list]]) -> dict[str, Any]:
    path = root / "heldout" / f"{split}.jsonl"
    h = hashlib.sha256()
    with atomic_open(path) as out:
        for dom in sorted(by_dom):
            for unit, (pos, _) in sorted(by_dom[dom].items()):
                h0, hlen = (0, 0) if pos is None else pos[6:8]
                if hlen:
                    with open(shard_dir / unit_name(unit, "heldout.jsonl"), "rb") as f:
                        f.seek(h0)
                        data = f.read(hlen)
                    out.write(data)
                    h.update(data)
    return {f"heldout/{path.name}": {"sha256": h.hexdigest(), "bytes": path.stat().st_size}}
