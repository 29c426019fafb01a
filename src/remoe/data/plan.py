"""The split plan: one pass over the document stream gives every document its split.

A document's split follows the hash rule of :func:`remoe.data.corpus.assign_splits`
(``u = blake2b("split", domain, key)``), decided as it streams by; the few corrections that
rule makes per domain (every domain trains on a document; a domain of >= 3 documents gets a
validation and a test document) need only each domain's counts, its three lowest-``u``
documents of each split and its highest-``u`` one, so they are applied afterwards to the
plan file in place. Memory: a few numbers per domain. Disk: one byte per document
(``plan.labels.u8``: 0 train, 1 validation, 2 test, in stream order), plus ``plan.json``
(per split and domain documents and bytes, the sources used), written last: its presence
means the plan is complete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from remoe.fileio import atomic_open, atomic_write_json, read_json
from remoe.data.builtin import builtin_sources
from remoe.data.corpus import split_unit
from remoe.data.documents import SPLITS
from remoe.data.errors import DataError, DataNotFoundError

log = logging.getLogger("remoe.data")

LABELS_FILE = "plan.labels.u8"
PLAN_FILE = "plan.json"
_KEEP_LOWEST = 3  # at most two corrections per domain: three lowest per split suffice


@dataclass
class _DomainTally:
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    nbytes: list[int] = field(default_factory=lambda: [0, 0, 0])
    lowest: list[list[tuple[float, str, int, int]]] = field(default_factory=lambda: [[], [], []])
    highest: tuple[float, str, int, int] | None = None

    def add(self, u: float, key: str, index: int, nbytes: int, label: int) -> None:
        self.counts[label] += 1
        self.nbytes[label] += nbytes
        item = (u, key, index, nbytes)
        low = self.lowest[label]
        if len(low) < _KEEP_LOWEST or item < low[-1]:
            low.append(item)
            low.sort()
            del low[_KEEP_LOWEST:]
        if self.highest is None or item > self.highest:
            self.highest = item


def natural_label(u: float, val_fraction: float, test_fraction: float) -> int:
    return 1 if u < val_fraction else 2 if u < val_fraction + test_fraction else 0


def corrections(t: _DomainTally, val_fraction: float, test_fraction: float) -> dict[int, int]:
    """``{stream index: new label}``: the moves ``assign_splits`` makes in this domain."""
    tracked: dict[int, list[Any]] = {}
    for lab, low in enumerate(t.lowest):
        for u, key, idx, nb in low:
            tracked[idx] = [u, key, lab, nb]
    assert t.highest is not None
    u, key, top, nb = t.highest
    tracked.setdefault(top, [u, key, natural_label(u, val_fraction, test_fraction), nb])
    counts = list(t.counts)
    moves: dict[int, int] = {}

    def move(i: int, lab: int) -> None:
        old = tracked[i][2]
        counts[old] -= 1
        counts[lab] += 1
        t.nbytes[old] -= tracked[i][3]
        t.nbytes[lab] += tracked[i][3]
        tracked[i][2] = lab
        moves[i] = lab

    if counts[0] == 0:  # every domain trains on a document: the highest-u one
        move(top, 0)
    n = sum(counts)
    needs = ((1, val_fraction), (2, test_fraction)) if n >= 3 else (
        ((1, val_fraction),) if n == 2 else ())
    for need, frac in needs:
        if frac <= 0 or counts[need]:
            continue
        donor = max((s for s in range(3) if s != need and (
            counts[s] > 1 or (n == 2 and s == 2 and counts[s]))),
            key=lambda s: (counts[s], s == 0))
        lowest = min((v[0], v[1], i) for i, v in tracked.items() if v[2] == donor)
        move(lowest[2], need)
    t.counts = counts
    return moves


def build_plan(docs: Iterable[Any], directory: Path, val_fraction: float, test_fraction: float,
               sources: list[str], found: dict[str, list]) -> dict[str, Any]:
    """Stream ``docs`` once and write the plan into ``directory``; returns ``plan.json``."""
    tallies: dict[str, _DomainTally] = {}
    n = 0
    with atomic_open(directory / LABELS_FILE, "wb") as f:
        buf = bytearray()
        for doc in docs:
            u = split_unit(doc.domain, doc.key)
            lab = natural_label(u, val_fraction, test_fraction)
            tallies.setdefault(doc.domain, _DomainTally()).add(u, doc.key, n, doc.num_bytes, lab)
            buf.append(lab)
            n += 1
            if len(buf) >= 1 << 20:
                f.write(buf)
                buf.clear()
        f.write(buf)
    where = f"{n} document(s) in {len(tallies)} domain(s) from {list(sources)}"
    big = found.get("too_big") or []
    too_big = (f"{len(big)} document(s) skipped: each is larger than data.max_bytes_per_domain="
               f"{(found.get('max_bytes') or [0])[0]:,} (largest {max(big):,} bytes); raise "
               "data.max_bytes_per_domain or split them") if big else ""
    if n == 0:
        missing = found.get("missing") or []
        install = sorted({s.install for s in builtin_sources() if s.name in missing})
        hint = f". Install a built-in source: {'; '.join(install)}" if install else ""
        extra = (f": {too_big}" if big else
                 " (no non-empty .txt/.jsonl/.jsonl.zst/.jsonl.gz/.parquet document)" + hint)
        raise DataNotFoundError(f"no documents found in data sources {list(sources)}{extra}")
    if too_big:
        log.warning("%s", too_big)
    labels = np.memmap(directory / LABELS_FILE, dtype=np.uint8, mode="r+", shape=(n,))
    for dom in sorted(tallies):
        for i, lab in corrections(tallies[dom], val_fraction, test_fraction).items():
            labels[i] = lab
    labels.flush()
    del labels
    splits = {s: {d: {"docs": t.counts[k], "bytes": t.nbytes[k]} for d, t in sorted(
        tallies.items()) if t.counts[k]} for k, s in enumerate(SPLITS)}
    _check(splits, tallies, val_fraction, test_fraction, where)
    plan = {"num_docs": n, "domains": sorted(tallies), "splits": splits,
            "sources_used": found.get("used", []), "sources_missing": found.get("missing", []),
            "licences": dict(found.get("licences", []))}
    atomic_write_json(directory / PLAN_FILE, plan)
    return plan


def _check(splits: dict[str, Any], tallies: dict[str, _DomainTally], val_fraction: float,
           test_fraction: float, where: str) -> None:
    if not splits["train"]:
        raise DataError(f"the train split is empty ({where})")
    single = [d for d, t in sorted(tallies.items()) if sum(t.counts) < 2]
    if not splits["validation"]:
        if val_fraction > 0:
            raise DataError(
                f"the validation split is empty: {where} are too few (a domain needs >= 2 "
                f"documents to give one to validation besides train): add documents (e.g. "
                f"split a large file into several) or use a source with more of them")
        log.warning("data.val_fraction=0: there is no validation split (`remoe train` needs one)")
    elif single and val_fraction > 0:
        log.warning("%d of %d domains have a single document, used for train only (no "
                    "validation loss for them): %s", len(single), len(tallies), ", ".join(single))
    if not splits["test"] and test_fraction > 0:
        log.warning("the test split is empty: %s are too few (a domain needs >= 3 documents "
                    "to give one to test)", where)


def load_plan(directory: Path) -> tuple[dict[str, Any], np.ndarray] | None:
    """The complete plan in ``directory`` (``plan.json`` and the labels, memory-mapped)."""
    plan = read_json(directory / PLAN_FILE)
    path = directory / LABELS_FILE
    if not isinstance(plan, dict) or not path.is_file() or (
            path.stat().st_size != plan.get("num_docs")):
        return None
    n = int(plan["num_docs"])
    return plan, np.memmap(path, dtype=np.uint8, mode="r", shape=(n,))
