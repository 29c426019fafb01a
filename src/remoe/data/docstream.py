"""The document stream of the sources: budgets, exact deduplication and stream order.

:func:`stream_documents` yields every document kept from ``DataConfig.sources`` in *stream
order*, the order that fixes where a document's tokens go: a ``builtin`` spec yields its kept
documents sorted by (domain, key) (the built-in corpus is small and collected in memory, as
before), a path spec yields them in file order (directories walked in sorted order), and specs
follow each other in the order given. Per domain, documents are kept greedily until the byte
budget is spent; an exact duplicate text (first occurrence wins) and an empty text are dropped.
Only fingerprints are remembered (:mod:`remoe.data.dedup`), so memory does not grow with the
texts. A path spec whose root name an earlier path spec already used gets ``#n`` appended to
its keys (``corpus/a.txt#2``), so keys stay unique.

The stream is a pure function of the sources and the budget: it is read once to plan the
splits, once to train the tokenizer (when one is trained) and once to tokenise.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

from remoe.data.builtin import BuiltinSource, builtin_sources
from remoe.data.corpus import SourceSpec, parse_source
from remoe.data._io import stable_hash
from remoe.fileio import atomic_open
from remoe.data.dedup import RecordedFingerprints, ReplayedFingerprints, SeenFingerprints
from remoe.data.documents import Document
from remoe.data.userdata import Warn, read_user_source

log = logging.getLogger("remoe.data")


class StreamBudget:
    """Greedy per-domain byte budget with exact-duplicate removal (fingerprints only)."""

    def __init__(self, max_bytes: int, spill_dir: Path, seen: Any = None):
        self.max_bytes = max_bytes
        self.used_bytes: dict[str, int] = {}
        self.seen = seen if seen is not None else SeenFingerprints(spill_dir)
        self.duplicates = 0
        self.too_big_bytes: list[int] = []

    def full(self, domain: str) -> bool:
        return self.max_bytes - self.used_bytes.get(domain, 0) < max(1, self.max_bytes // 200)

    def offer(self, doc: Document, user: bool) -> bool:
        if not doc.text.strip():
            return False
        n = doc.num_bytes
        used = self.used_bytes.get(doc.domain, 0)
        if used + n > self.max_bytes:
            if user and n > self.max_bytes:
                self.too_big_bytes.append(n)
            return False
        if not self.seen.add_if_new(doc.text):
            self.duplicates += 1
            return False
        self.used_bytes[doc.domain] = used + n
        return True


def budget_order(source: BuiltinSource, cands: list) -> list:
    """The order a built-in source's candidates are offered to the budget (seed-free)."""
    return sorted(cands, key=lambda c: (stable_hash("budget-order", source.domain, c.key), c.key))


def _builtin_docs(spec: SourceSpec, budget: StreamBudget, seen_sources: set[str],
                  found: dict[str, list], warn: Warn) -> list[Document]:
    kept: list[Document] = []
    seen_key: dict[tuple[str, str], int] = {}
    src: BuiltinSource
    for src in builtin_sources(spec.domains):
        if src.name in seen_sources:
            continue
        seen_sources.add(src.name)
        cands = src.candidates()
        if cands is None:
            warn("built-in source %r (domain %r) not found; install it with: %s -- building "
                 "without it", src.name, src.domain, src.install)
            found["missing"].append(src.name)
            continue
        found["used"].append(src.name)
        found["licences"].append((src.name, src.licence))
        for cand in budget_order(src, cands):
            if budget.full(src.domain):
                break
            text = cand.load()
            if text is None:
                continue
            doc = Document(src.domain, cand.key, text)
            if budget.offer(doc, user=False):
                k = (doc.domain, doc.key)
                seen_key[k] = seen_key.get(k, 0) + 1
                if seen_key[k] > 1:
                    doc = Document(doc.domain, f"{doc.key}#{seen_key[k]}", doc.text)
                kept.append(doc)
    kept.sort(key=lambda d: (d.domain, d.key))
    return kept


def stream_documents(sources: list[str], max_bytes_per_domain: int, spill_dir: Path,
                     found: dict[str, list] | None = None, *, record: Path | None = None,
                     replay: Path | None = None, warn: Warn = log.warning) -> Iterator[Document]:
    """Kept documents of ``sources`` in stream order (see the module docstring).

    ``found`` (optional) receives ``used`` / ``missing`` source names and ``licences``.
    ``record``: write the deduplication answers there (atomically, when the stream ends);
    ``replay``: take them from there instead of fingerprinting (:mod:`remoe.data.dedup`).
    ``warn``: how the readers warn (the passes after the first pass a quiet one, so each
    warning is printed once per build). A Megatron indexed dataset yields
    :class:`~remoe.data.megatron.TokenDocument` s (token ids, no text; no budget or
    deduplication: they were prepared already).
    """
    found = found if found is not None else {}
    for k in ("used", "missing", "licences"):
        found.setdefault(k, [])
    if record is not None:
        fingerprints = SeenFingerprints(spill_dir)
        try:
            with atomic_open(record) as out:
                seen = RecordedFingerprints(fingerprints, out)
                yield from _stream(sources, StreamBudget(max_bytes_per_domain, spill_dir, seen),
                                   found, warn)
        finally:
            fingerprints.close()
            shutil.rmtree(spill_dir, ignore_errors=True)  # the answers are recorded
    elif replay is not None:
        seen = ReplayedFingerprints(replay)
        try:
            yield from _stream(sources, StreamBudget(max_bytes_per_domain, spill_dir, seen),
                               found, warn)
        finally:
            seen.close()
    else:
        yield from _stream(sources, StreamBudget(max_bytes_per_domain, spill_dir), found, warn)


def _stream(sources: list[str], budget: StreamBudget, found: dict[str, list], warn: Warn
            ) -> Iterator[Document]:
    from remoe.data.megatron import is_megatron_spec

    max_bytes_per_domain = budget.max_bytes
    seen_builtin: set[str] = set()
    roots: dict[str, int] = {}
    n_megatron = 0
    for spec in (parse_source(s) for s in sources):
        if spec.kind == "builtin":
            yield from _builtin_docs(spec, budget, seen_builtin, found, warn)
            continue
        assert spec.path is not None
        if is_megatron_spec(spec):
            from remoe.data.megatron import megatron_prefix, read_megatron

            found["used"].append(spec.describe())
            prefix = megatron_prefix(spec.path)
            assert prefix is not None
            # no budget, no dedup; numbered in source order (remoe.data.megatron)
            yield from read_megatron(prefix, spec.domain or prefix.name, n_megatron)
            n_megatron += 1
            continue
        found["used"].append(spec.describe())
        root = Path(spec.path).resolve().name
        roots[root] = roots.get(root, 0) + 1
        suffix = f"#{roots[root]}" if roots[root] > 1 else ""
        for doc in read_user_source(spec.path, spec.domain, dict(spec.options), warn):
            if suffix:
                doc = Document(doc.domain, doc.key + suffix, doc.text)
            if budget.offer(doc, user=True):
                yield doc
    if budget.duplicates:
        warn("dropped %d exact duplicate documents", budget.duplicates)
    if budget.too_big_bytes:
        found.setdefault("too_big", []).extend(budget.too_big_bytes)
        found["max_bytes"] = [max_bytes_per_domain]
