"""Source specs and document splits (the budgets, deduplication and stream order of the
documents they name: :mod:`remoe.data.docstream`).

Source specs (``DataConfig.sources``):

* ``builtin`` -- every built-in domain (:mod:`remoe.data.builtin`);
  ``builtin:code,prose`` -- only those domains;
* ``PATH`` -- a ``.txt`` / ``.jsonl`` / ``.jsonl.zst`` file or a directory of them
  (:mod:`remoe.data.userdata`);
* ``NAME=PATH`` -- the same with every document's domain set to ``NAME``.

Splits are held out at document level: a document goes to validation when
``u < val_fraction``, to test when ``u < val_fraction + test_fraction``, else to train, where
``u`` in [0, 1) is a blake2b hash of ``(domain, key)`` -- independent of the seed, of the
other documents and of the machine. Every domain trains on at least one document (its
highest-``u`` one when the hash sent them all to held-out splits); a domain of two documents
always gets one validation document and one of at least three documents always gets at least
one validation and one test document (its lowest-``u`` train documents are moved over), unless
the fraction is 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from remoe.data._io import stable_unit
from remoe.data.builtin import BUILTIN_DOMAINS
from remoe.data.documents import SPLITS, Document

_NAMED_SPEC = re.compile(r"^([A-Za-z0-9_.+-]+)=(.+)$")


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "builtin" or "path"
    domains: tuple[str, ...] | None = None  # builtin subset
    path: str | None = None
    domain: str | None = None  # name override for a path
    options: tuple[tuple[str, str], ...] = ()  # PATH?text=COL&domain=COL (Parquet columns)

    def describe(self) -> str:
        if self.kind == "builtin":
            return "builtin" + (":" + ",".join(self.domains) if self.domains else "")
        return f"{self.domain}={self.path}" if self.domain else str(self.path)


def parse_source(spec: str) -> SourceSpec:
    """Parse one source spec string (see the module docstring); raises ValueError."""
    s = spec.strip()
    if not s:
        raise ValueError("empty source spec")
    if s == "builtin":
        return SourceSpec("builtin")
    if s.startswith("builtin:"):
        doms = tuple(d.strip() for d in s[len("builtin:"):].split(",") if d.strip())
        unknown = [d for d in doms if d not in BUILTIN_DOMAINS]
        if not doms or unknown:
            raise ValueError(f"source {spec!r}: unknown built-in domain(s) {unknown or '(none)'}; "
                             f"known: {', '.join(BUILTIN_DOMAINS)}")
        return SourceSpec("builtin", domains=doms)
    options: tuple[tuple[str, str], ...] = ()
    if "?" in s and not Path(s).exists():
        s, query = s.split("?", 1)
        pairs = [q.split("=", 1) for q in query.split("&") if q]
        bad = [q for q in pairs if len(q) != 2 or q[0] not in ("text", "domain") or not q[1]]
        if bad:
            raise ValueError(f"source {spec!r}: options are ?text=COLUMN&domain=COLUMN")
        options = tuple((k, v) for k, v in pairs)
    m = _NAMED_SPEC.match(s)
    if m and not Path(s).exists():
        return SourceSpec("path", path=m.group(2), domain=m.group(1), options=options)
    return SourceSpec("path", path=s, options=options)


# -- splits ---------------------------------------------------------------------------------------


def split_unit(domain: str, key: str) -> float:
    """The document's position in [0, 1) that decides its split."""
    return stable_unit("split", domain, key)


def assign_splits(docs: dict[str, list[Document]], val_fraction: float,
                  test_fraction: float) -> dict[str, list[Document]]:
    """``{"train": [...], "validation": [...], "test": [...]}``, each ordered by (domain, key)."""
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for dom in sorted(docs):
        ranked = sorted(docs[dom], key=lambda d: (split_unit(dom, d.key), d.key))
        us = [split_unit(dom, d.key) for d in ranked]
        labels = ["validation" if u < val_fraction
                  else "test" if u < val_fraction + test_fraction else "train" for u in us]
        if "train" not in labels:  # every domain trains on at least one document
            labels[-1] = "train"  # the highest-u one, the nearest to being train already
        needs = (("validation", val_fraction), ("test", test_fraction)) if len(ranked) >= 3 else (
            (("validation", val_fraction),) if len(ranked) == 2 else ())
        for need, frac in needs:
            if frac <= 0 or need in labels:
                continue
            # move the lowest-u document of the largest other split (train, normally)
            counts = {s: labels.count(s) for s in SPLITS}
            donor = max((s for s in SPLITS if s != need and (
                counts[s] > 1 or (len(ranked) == 2 and s == "test" and counts[s]))),
                key=lambda s: (counts[s], s == "train"))
            labels[labels.index(donor)] = need
        for d, lab in zip(ranked, labels):
            out[lab].append(d)
    for s in SPLITS:
        out[s].sort(key=lambda d: (d.domain, d.key))
    return out


# -- persistence ----------------------------------------------------------------------------


def iter_documents(path: str | Path, domain: str | None = None) -> Iterator[Document]:
    """Read Pile-format JSONL (``meta.pile_set_name`` = domain, ``meta.key``), optionally one
    domain only."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            meta = rec.get("meta") or {}
            dom = meta.get("pile_set_name", "unknown")
            if domain is not None and dom != domain:
                continue
            yield Document(dom, meta.get("key", ""), rec["text"])
