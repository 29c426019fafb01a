"""Collecting a corpus from source specs, byte budgets, deduplication and document splits.

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

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from remoe.data._io import atomic_open, stable_hash, stable_unit
from remoe.data.builtin import BUILTIN_DOMAINS, BuiltinSource, builtin_sources
from remoe.data.documents import SPLITS, Document
from remoe.data.errors import DataNotFoundError
from remoe.data.userdata import read_user_source

log = logging.getLogger("remoe.data")

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


@dataclass
class Corpus:
    """Documents per domain (sorted by key) plus what was found and skipped."""

    docs: dict[str, list[Document]]
    sources_used: list[str] = field(default_factory=list)
    sources_missing: list[str] = field(default_factory=list)
    licences: dict[str, str] = field(default_factory=dict)

    @property
    def domains(self) -> list[str]:
        return sorted(self.docs)

    def fingerprints(self) -> dict[str, str]:
        """sha256 of each domain's documents (keys and texts, in order)."""
        out = {}
        for dom in self.domains:
            h = hashlib.sha256()
            for d in self.docs[dom]:
                for part in (d.key, d.text):
                    b = part.encode("utf-8")
                    h.update(len(b).to_bytes(8, "little"))
                    h.update(b)
            out[dom] = h.hexdigest()
        return out

    def num_bytes(self) -> dict[str, int]:
        return {dom: sum(d.num_bytes for d in self.docs[dom]) for dom in self.domains}


class _Budget:
    """Greedy per-domain byte budget with exact-duplicate removal."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used: dict[str, int] = {}
        self.docs: dict[str, list[Document]] = {}
        self.seen_text: set[bytes] = set()
        self.seen_key: dict[tuple[str, str], int] = {}
        self.duplicates = 0
        self.over_budget = 0
        self.too_big: list[int] = []  # sizes of documents larger than the whole budget

    def full(self, domain: str) -> bool:
        # stop scanning once less than 0.5% of the budget is left
        return self.max_bytes - self.used.get(domain, 0) < max(1, self.max_bytes // 200)

    def offer(self, doc: Document, user: bool = False) -> bool:
        if not doc.text.strip():
            return False
        n = doc.num_bytes
        used = self.used.get(doc.domain, 0)
        if used + n > self.max_bytes:
            self.over_budget += 1
            if user and n > self.max_bytes:  # (a built-in source's big files are expected)
                self.too_big.append(n)
            return False
        digest = hashlib.blake2b(doc.text.encode("utf-8"), digest_size=16).digest()
        if digest in self.seen_text:
            self.duplicates += 1
            return False
        self.seen_text.add(digest)
        k = (doc.domain, doc.key)
        count = self.seen_key.get(k, 0) + 1
        self.seen_key[k] = count
        if count > 1:  # same key from two sources: keep both, disambiguated
            doc = Document(doc.domain, f"{doc.key}#{count}", doc.text)
        self.used[doc.domain] = used + n
        self.docs.setdefault(doc.domain, []).append(doc)
        return True


def budget_order(source: BuiltinSource, cands: list) -> list:
    return sorted(cands, key=lambda c: (stable_hash("budget-order", source.domain, c.key), c.key))


def collect_corpus(sources: Iterable[str], max_bytes_per_domain: int) -> Corpus:
    """Read every source spec into a :class:`Corpus` within the per-domain byte budget.

    Missing built-in sources are logged as warnings with their install command; raises
    :class:`DataNotFoundError` (a ConfigError and a FileNotFoundError) naming the sources if
    nothing at all was found.
    """
    specs = [parse_source(s) for s in sources]
    budget = _Budget(max_bytes_per_domain)
    used: list[str] = []
    missing: list[str] = []
    licences: dict[str, str] = {}
    seen_builtin: set[str] = set()
    for spec in specs:
        if spec.kind == "builtin":
            for src in builtin_sources(spec.domains):
                if src.name in seen_builtin:
                    continue
                seen_builtin.add(src.name)
                cands = src.candidates()
                if cands is None:
                    log.warning("built-in source %r (domain %r) not found; install it with: %s "
                                "-- building without it", src.name, src.domain, src.install)
                    missing.append(src.name)
                    continue
                used.append(src.name)
                licences[src.name] = src.licence
                for cand in budget_order(src, cands):
                    if budget.full(src.domain):
                        break
                    text = cand.load()
                    if text is not None:
                        budget.offer(Document(src.domain, cand.key, text))
        else:
            assert spec.path is not None
            used.append(spec.describe())
            for doc in read_user_source(spec.path, spec.domain):
                budget.offer(doc, user=True)
    big = ""
    if budget.too_big:
        big = (f"{len(budget.too_big)} document(s) skipped: each is larger than "
               f"data.max_bytes_per_domain={max_bytes_per_domain:,} (largest "
               f"{max(budget.too_big):,} bytes); raise data.max_bytes_per_domain or split them")
    if not budget.docs:
        if big:
            raise DataNotFoundError(f"no documents found in data sources {list(sources)}: {big}")
        hint = ""
        if missing:
            cmds = sorted({s.install for s in builtin_sources() if s.name in missing})
            hint = " Install a built-in source: " + "; ".join(cmds)
        raise DataNotFoundError(f"no documents found in data sources {list(sources)} (no "
                                f"non-empty .txt/.jsonl/.jsonl.zst/.jsonl.gz document).{hint}")
    if budget.duplicates:
        log.info("dropped %d exact duplicate documents", budget.duplicates)
    if big:
        log.warning("%s", big)
    docs = {dom: sorted(ds, key=lambda d: d.key) for dom, ds in sorted(budget.docs.items())}
    return Corpus(docs, used, missing, licences)


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


def write_documents(path: str | Path, docs: Iterable[Document]) -> None:
    """Write documents as Pile-format JSONL (``meta.pile_set_name`` = domain, ``meta.key``)."""
    with atomic_open(path, "wb") as f:
        for d in docs:
            rec = {"text": d.text, "meta": {"pile_set_name": d.domain, "key": d.key}}
            f.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")


def iter_documents(path: str | Path, domain: str | None = None) -> Iterator[Document]:
    """Read back :func:`write_documents` output, optionally one domain only."""
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
