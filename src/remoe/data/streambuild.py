"""Building the sharded store: plan -> tokenizer -> shards -> index -> manifest, resumably.

Layout (``<cache_dir>/store-v2/``)::

    manifest.json                 the finished store: key, config, domains, sizes, file checksums
    <key16>/sources.json          the sources' files as the build began (:mod:`.sourcecheck`)
    <key16>/plan.labels.u8        one split label per kept document, in stream order
    <key16>/plan.json             per split and domain counts (written when the plan is complete)
    <key16>/tokenizer.json
    <key16>/shards/u*.{bin,lens.npy,heldout.jsonl} + journal.jsonl
    <key16>/index/*.npy, <key16>/heldout/{validation,test}.jsonl

``<key16>`` is the start of the build key: a sha256 of the data settings, the shard size and
the sources' *fingerprint* -- (path, size, mtime) of every user file and the candidate list of
the built-in sources, read without reading the texts. Opening a finished store costs a
``stat`` per file, whatever its size. An interrupted build resumes in the same directory:
a complete plan and tokenizer are reused, finished units are not redone (:mod:`.shards`),
once the sources are read again and found unchanged; a changed source discards the build.
What a killed build leaves is swept first (:mod:`.leftovers`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer

from remoe.data import tokenizer as _tok
from remoe.data._io import sha256_bytes, sha256_file, stable_unit, stage_key
from remoe.fileio import atomic_write_json, read_json
from remoe.data.config import DEFAULT_TOKENIZER_TRAIN_BYTES, DataConfig
from remoe.data.corpus import parse_source
from remoe.data.docstream import stream_documents
from remoe.data.documents import SPLITS
from remoe.data.errors import DataError
from remoe.data.leftovers import discard, sweep
from remoe.data.megatron import external_entries, external_problem, megatron_prefixes
from remoe.data.plan import build_plan, load_plan
from remoe.data.shardindex import write_split_index
from remoe.data.shards import DEFAULT_SHARD_BYTES, build_shards, iter_units, read_journal
from remoe.data.shardstore import file_problem
from remoe.data.sourcecheck import (canonical_sources, check_token_ids, record_sources,
                                    source_changes, source_files)
from remoe.data.shardstore import token_dtype

STORE_DIR = "store-v2"
STORE_FORMAT = "remoe-shards/1"
MIN_FREQUENCY = 2
TOKENIZER_ALGO = "bytelevel-bpe/1"
TOKENIZER_FILE = "tokenizer.json"  # the store's tokenizer, beside its manifest
SOURCES_FILE = "sources.json"  # <key16>/: what the build was taken from (remoe.data.sourcecheck)

log = logging.getLogger("remoe.data")


def source_fingerprint(sources: list[str]) -> list[Any]:
    """What identifies the sources without reading their texts (see the module docstring)."""
    from remoe.data.builtin import builtin_sources
    from remoe.data.corpus import parse_source

    out: list[Any] = []
    for s in sources:
        spec = parse_source(s)
        if spec.kind == "builtin":
            for src in builtin_sources(spec.domains):
                cands = src.candidates()
                keys = None if cands is None else sha256_bytes(
                    "\n".join(c.key for c in cands).encode("utf-8"))
                out.append([src.name, keys])
            continue
        out.append([s, [[str(p), st.st_size, st.st_mtime_ns] for p in source_files(s)
                        for st in (p.stat(),)]])
    return out


def build_key(cfg: DataConfig, fingerprint: list[Any]) -> str:
    """The store's key, from the settings and the sources' ``fingerprint``
    (:func:`source_fingerprint`); the shard size is not part of it (it changes the files, not
    the data)."""
    tok = None
    if cfg.tokenizer is not None:
        tok = sha256_bytes(_tok.load_tokenizer(Path(cfg.tokenizer)).to_str().encode("utf-8"))
    return stage_key({"format": STORE_FORMAT, "sources": list(cfg.sources),
                      "fingerprint": fingerprint,
                      "max_bytes": cfg.max_bytes_per_domain, "val": cfg.val_fraction,
                      "test": cfg.test_fraction, "vocab": cfg.vocab_size, "tokenizer": tok,
                      "tokenizer_train_bytes": cfg.tokenizer_train_bytes,
                      "algo": TOKENIZER_ALGO})


_CONFIG_FIELDS = ("sources", "max_bytes_per_domain", "val_fraction", "test_fraction",
                  "vocab_size", "tokenizer", "tokenizer_train_bytes")


def rebuild_reason(store: Path, cfg: DataConfig, key: str, fingerprint: list[Any]) -> str | None:
    """Why the finished store in ``store`` (if any) cannot serve ``cfg`` (build key ``key``),
    in words; None when there is none (a first build). Names the setting, the source file or
    the damaged file."""
    m = read_json(store / "manifest.json")
    if not isinstance(m, dict):
        return None
    if m.get("format") != STORE_FORMAT:
        return f"the store's format is {m.get('format')!r}, this version writes {STORE_FORMAT!r}"
    if m.get("key") == key:  # the same settings and sources: a file of it is damaged
        listed = _listed_files(store, m)
        if listed is None:
            return "its manifest is malformed"
        root, files = listed
        for rel, meta in files.items():
            p = file_problem(root / rel, meta, full=False)
            if p is not None:
                return f"{rel}: {p}"
        for e in m.get("external", {}).values():
            p = external_problem(e, full=False)
            if p is not None:
                return p
        return "its files do not match its manifest"
    old = m.get("config", {})
    for f in _CONFIG_FIELDS:
        if old.get(f) != getattr(cfg, f):
            return f"data.{f} changed ({old.get(f)!r} -> {getattr(cfg, f)!r})"
    why = fingerprint_change(m.get("fingerprint", []), fingerprint)
    if why is not None:
        return why
    if cfg.tokenizer is not None:
        return f"the tokenizer file {cfg.tokenizer} changed"
    return "the sources changed"


def fingerprint_change(before: list[Any], now: list[Any]) -> str | None:
    """The first difference between two :func:`source_fingerprint` s, in words (sources
    missing from ``before`` are not compared: the settings say that)."""
    was_by_name = {json.dumps(e[0]): e[1] for e in before}
    for name, files in now:
        was = was_by_name.get(json.dumps(name))
        if was is not None and was != files:
            if isinstance(files, list) and isinstance(was, list):
                old_files = {f[0]: f[1:] for f in was}
                for path, size, mtime in files:
                    if old_files.get(path) != [size, mtime]:
                        return (f"source file {path} changed (size or modification time)"
                                if path in old_files else f"source file {path} is new")
                return f"a file of source {name} was removed"
            return f"the built-in source {name} changed"
    return None


def finished_manifest(store: Path, key: str | None) -> dict[str, Any] | None:
    """The finished store's manifest if its key is ``key`` (any key: None) and every file it
    lists has its recorded size (no hashing: shards are checked when first mapped)."""
    m = read_json(store / "manifest.json")
    if not isinstance(m, dict) or m.get("format") != STORE_FORMAT or (
            key is not None and m.get("key") != key):
        return None
    listed = _listed_files(store, m)
    if listed is None:
        return None
    root, files = listed
    for rel, meta in files.items():
        if file_problem(root / rel, meta, full=False) is not None:
            return None
    if any(external_problem(e, full=False) for e in m.get("external", {}).values()):
        return None
    return m


def _listed_files(store: Path, m: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The store directory and the files a manifest lists; None if it is malformed."""
    try:
        files = all_files(m)
        if not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and
                   isinstance(v.get("sha256"), str) for v in files.values()):
            return None
        return store / m["dir"], files
    except (KeyError, TypeError, AttributeError):
        return None


def all_files(m: dict[str, Any]) -> dict[str, Any]:
    files = {f"shards/{k}": v for k, v in m["shards"].items()}
    files[TOKENIZER_FILE] = {"sha256": m["tokenizer"]["sha256"], "bytes": m["tokenizer"]["bytes"]}
    for s in SPLITS:
        files.update(m["tokens"]["splits"][s]["files"])
    return files


DEDUP_FILE = "plan.dedup.u8"  # the plan pass's deduplication answers, replayed by the others


def _docs(cfg: DataConfig, root: Path, found: dict | None = None, *, plan: bool = False):
    replay = root / DEDUP_FILE
    # the plan pass reads the sources first and says what it finds; the later passes are quiet
    return stream_documents(list(cfg.sources), cfg.max_bytes_per_domain, root / "dedup", found,
                            record=replay if plan else None,
                            replay=replay if not plan and replay.is_file() else None,
                            warn=log.warning if plan else log.debug)


def _tokenizer(cfg: DataConfig, root: Path, plan: dict[str, Any], labels, say: Callable,
               progress: bool) -> Tokenizer:
    path = root / TOKENIZER_FILE
    if cfg.tokenizer is not None:
        tok = _tok.load_tokenizer(Path(cfg.tokenizer))
        _tok.save_tokenizer(tok, path)
        return tok
    if path.is_file() and (root / "tokenizer.done").is_file():
        return Tokenizer.from_file(str(path))
    train_bytes = {d: v["bytes"] for d, v in plan["splits"]["train"].items()}
    total = sum(train_bytes.values())
    cap = cfg.tokenizer_train_bytes or DEFAULT_TOKENIZER_TRAIN_BYTES
    keep_share = {d: 1.0 if total <= cap else (cap * b / total) / max(b, 1)
                  for d, b in train_bytes.items()}

    def texts():
        for i, doc in enumerate(_docs(cfg, root)):
            if labels[i] == 0 and doc.text is not None and (keep_share[doc.domain] >= 1.0 or (
                    stable_unit("tokenizer-sample", doc.domain, doc.key) < keep_share[doc.domain])):
                yield doc.text

    say(f"training byte-level BPE (vocab {cfg.vocab_size}) on the train split "
        f"({total:,} bytes{'' if total <= cap else f', sampled to ~{cap:,}'})")
    tok = _tok.train_tokenizer(_tok.batched_texts(texts()), cfg.vocab_size,
                               min_frequency=MIN_FREQUENCY, progress=progress)
    _tok.save_tokenizer(tok, path)
    (root / "tokenizer.done").write_bytes(b"")
    return tok


def resolved_config(cfg: DataConfig) -> DataConfig:
    """``cfg`` with its sources and tokenizer spelled absolutely: one file under two spellings
    (``my.jsonl``, ``/home/me/my.jsonl``) is one source, one key, one store."""
    tok = None if cfg.tokenizer is None else os.path.abspath(os.path.expanduser(str(cfg.tokenizer)))
    return dataclasses.replace(cfg, sources=canonical_sources(list(cfg.sources)), tokenizer=tok)


def _source_record(root: Path, cfg: DataConfig, vocab: int, cache: Path
                   ) -> list[dict[str, Any]]:
    """What the build in ``root`` is taken from (:mod:`remoe.data.sourcecheck`). An interrupted
    build is resumed only if its sources are what it recorded (read again, in full); otherwise
    it is discarded whole. Refuses pre-tokenised sources the tokenizer does not fit."""
    path = root / SOURCES_FILE
    if root.is_dir():
        recorded = read_json(path)
        problems = (source_changes(recorded, list(cfg.sources)) if isinstance(recorded, list)
                    else ["the interrupted build has no record of its sources"])
        if not problems:
            check_token_ids(recorded, cfg.tokenizer, vocab)
            return recorded
        log.warning("data cache %s: %s; discarding the interrupted build (plan, tokenizer, "
                    "units) and starting again", cache, problems[0])
        discard(root)
    record = record_sources(list(cfg.sources))
    check_token_ids(record, cfg.tokenizer, vocab)  # before any other work
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    return record


def build_store(cfg: DataConfig, cache: Path, say: Callable[[str], None], progress: bool, *,
                workers: int = 1, shard_bytes: int = DEFAULT_SHARD_BYTES,
                before_write: Callable[[str], None] = lambda what: None) -> dict[str, Any]:
    """Build (or resume, or reuse) the store of ``cfg``; returns its manifest."""
    store = cache / STORE_DIR
    cfg = resolved_config(cfg)
    fingerprint = source_fingerprint(list(cfg.sources))  # one stat per source file
    key = build_key(cfg, fingerprint)
    m = finished_manifest(store, key)
    if m is not None:
        say("sharded store unchanged: reusing it")
        return m
    why = rebuild_reason(store, cfg, key, fingerprint)
    if why is not None:
        log.warning("data cache %s: %s; building the sharded store again", cache, why)
    given_tok = None if cfg.tokenizer is None else _tok.load_tokenizer(Path(cfg.tokenizer))
    before_write("its sharded store")
    sweep(store)  # what a killed or failed build left (under the lock: nobody else writes)
    root = store / key[:16]
    record = _source_record(root, cfg, cfg.vocab_size if given_tok is None else
                            _tok.tokenizer_vocab_size(given_tok), cache)
    if (root / "shard_bytes.json").is_file():
        units = len(read_journal(root / "shards"))
        log.warning("data cache %s: resuming an interrupted build (plan %s, %d unit(s) "
                    "finished)", cache, "done" if load_plan(root) is not None else "to redo",
                    units)
    recorded = read_json(root / "shard_bytes.json")  # a resumed build keeps its unit size
    if isinstance(recorded, int) and recorded > 0:
        shard_bytes = recorded
    else:
        atomic_write_json(root / "shard_bytes.json", shard_bytes)
    loaded = load_plan(root)
    if loaded is None:
        say(f"planning splits from {list(cfg.sources)} (<= {cfg.max_bytes_per_domain:,} "
            "bytes/domain)")
        found: dict[str, list] = {}
        build_plan(_docs(cfg, root, found, plan=True), root, cfg.val_fraction, cfg.test_fraction,
                   list(cfg.sources), found)
        loaded = load_plan(root)
        assert loaded is not None
    plan, labels = loaded
    domains = plan["domains"]
    tok = _tokenizer(cfg, root, plan, labels, say, progress)
    eos = _tok.find_eos(tok)
    assert eos is not None
    vocab = _tok.tokenizer_vocab_size(tok)
    dtype = token_dtype(vocab)
    shard_dir = root / "shards"
    done_units = [0, 0]

    def on_unit(meta: dict[str, Any], encoded: bool) -> None:
        done_units[encoded] += 1
        if encoded and progress:
            say(f"unit {meta['unit']} written ({done_units[1]} encoded, {done_units[0]} reused)")

    say(f"tokenising with {workers} worker(s) into shards of ~{shard_bytes:,} bytes of text")
    dom_index = {d: i for i, d in enumerate(domains)}
    external = megatron_prefixes(list(cfg.sources))
    metas = build_shards(iter_units(_docs(cfg, root), labels, dom_index, shard_bytes,
                                    eos[1] if external else None), shard_dir,
                         {"tokenizer_json": tok.to_str(), "eos_id": eos[1], "dtype": dtype.name,
                          "vocab_size": vocab, "out_dir": str(shard_dir), "domains": domains},
                         workers, on_unit)
    # a stat per user file (the built-in candidates are not listed again: ~1.4 s)
    changed = fingerprint_change(fingerprint, source_fingerprint(
        [s for s in cfg.sources if parse_source(s).kind == "path"]))
    if changed is not None:  # what was read is not what was recorded: never finish a mix
        discard(root)
        raise DataError(f"data cache {cache}: {changed} while the store was being built; "
                        "run the build again once the sources stay as they are")
    splits = {s: write_split_index(root, shard_dir, s, metas, domains, external) for s in SPLITS}
    shards = {name: meta for u in metas for name, meta in u["files"].items()
              if name.endswith(".bin")}
    used = sorted({n for e in splits.values() for n in e.get("external", ())})
    ext = external_entries(external, used, record) if used else {}
    max_id = max([int(u.get("max_id", vocab - 1)) for u in metas] +
                 [int(e["max_id"]) for e in ext.values() if e["max_id"] is not None],
                 default=-1)
    m = {"format": STORE_FORMAT, "key": key, "dir": key[:16], "domains": domains,
         "dtype": dtype.name,
         "config": {"sources": list(cfg.sources), "max_bytes_per_domain": cfg.max_bytes_per_domain,
                    "val_fraction": cfg.val_fraction, "test_fraction": cfg.test_fraction,
                    "vocab_size": cfg.vocab_size, "tokenizer": cfg.tokenizer,
                    "tokenizer_train_bytes": cfg.tokenizer_train_bytes,
                    "shard_bytes": shard_bytes},
         "corpus": {"splits": plan["splits"], "sources_used": plan["sources_used"],
                    "sources_missing": plan["sources_missing"], "licences": plan["licences"]},
         "tokenizer": {"sha256": sha256_file(root / TOKENIZER_FILE),
                       "bytes": (root / TOKENIZER_FILE).stat().st_size,
                       "source": (f"loaded from {cfg.tokenizer}" if cfg.tokenizer
                                  else f"trained (byte-level BPE, vocab {cfg.vocab_size})"),
                       "vocab_size": vocab, "eos_token": eos[0], "eos_id": eos[1]},
         "tokens": {"dtype": dtype.name, "splits": splits, "max_id": max_id},
         "shards": shards, "fingerprint": fingerprint, "sources": record}
    if ext:
        m["external"] = ext
    atomic_write_json(store / "manifest.json", m)
    for other in store.iterdir():  # earlier builds of other settings
        if other.is_dir() and other.name != root.name:
            shutil.rmtree(other, ignore_errors=True)
    say("data ready")
    return m


def verify_store(cache: Path) -> list[str]:
    """Every problem of the finished store in ``cache``: the full sha256 of every file of it
    and of every source file it was built from. A damaged shard is deleted (the next build
    redoes its unit); a changed source discards the whole build (plan, tokenizer, units,
    index, held-out copies), so the next build starts again from the sources, never mixing
    old and new data."""
    store = cache / STORE_DIR
    m = read_json(store / "manifest.json")
    listed = _listed_files(store, m) if isinstance(m, dict) else None
    if listed is None or m.get("format") != STORE_FORMAT:
        return [f"no finished sharded store in {store} (run `remoe data`)"]
    root, files = listed
    problems = []
    for rel, meta in sorted(files.items()):
        p = file_problem(root / rel, meta, full=True)
        if p is not None:
            problems.append(f"{rel}: {p}")
            if rel.startswith("shards/") and (root / rel).is_file():
                os.unlink(root / rel)  # the next `remoe data` rebuilds that unit
    if isinstance(m.get("sources"), list):
        changed = source_changes(m["sources"], list(m.get("config", {}).get("sources", [])))
    else:  # a store of an earlier version: only its in-place files were recorded
        changed = [p for e in m.get("external", {}).values()
                   if (p := external_problem(e, full=True)) is not None]
    if (problems or changed) and (store / "manifest.json").is_file():
        os.unlink(store / "manifest.json")
    if changed:
        discard(root)
        changed[-1] += " -- everything built from the sources is discarded and built again"
    return problems + changed


def train_documents(root: Path, domain: str | None = None) -> list:
    """The train documents of the store in ``root``, read again from the sources (their text
    is not kept; token ids are decoded), domain by domain in stream order. The sources must
    not have changed."""
    from remoe.data.config import DataConfig
    from remoe.data.documents import Document

    m = read_json(root.parent / "manifest.json")
    loaded = load_plan(root)
    if not isinstance(m, dict) or loaded is None:
        raise FileNotFoundError(f"no finished sharded store in {root.parent} (run `remoe data`)")
    c = m["config"]
    cfg = DataConfig(sources=c["sources"], max_bytes_per_domain=c["max_bytes_per_domain"])
    _, labels = loaded
    tok = Tokenizer.from_file(str(root / TOKENIZER_FILE))
    out: list[Document] = []
    for i, d in enumerate(_docs(cfg, root)):
        if labels[i] != 0 or (domain is not None and d.domain != domain):
            continue
        if d.text is None:  # token ids (Megatron): decoded, without a final end-of-text
            ids = d.ids[:-1] if d.ids.shape[0] and int(d.ids[-1]) == m["tokenizer"]["eos_id"] \
                else d.ids
            d = Document(d.domain, d.key, tok.decode(ids.tolist(), skip_special_tokens=False))
        out.append(d)
    out.sort(key=lambda d: d.domain)  # stable: stream order within a domain
    return out
