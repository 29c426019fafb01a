"""The three build stages of the data cache: corpus files, tokenizer, token arrays.

Each stage compares its key (:func:`remoe.data.manifest.stage_key` of everything it depends
on) and its files (sizes and sha256) with the previous manifest entry: a match is reused as
is, anything else is rebuilt with a warning saying why. Each returns its new manifest entry.
Called in order, under the cache lock, by :func:`remoe.data.pipeline.prepare_data`.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from remoe.data import store as _store
from remoe.data import tokenizer as _tok
from remoe.data._io import sha256_bytes, sha256_file, stable_hash
from remoe.data.config import DataConfig
from remoe.data.corpus import Corpus, assign_splits, collect_corpus, write_documents
from remoe.data.documents import SPLITS, Document
from remoe.data.errors import DataError
from remoe.data.manifest import FORMAT_VERSION, TOKENIZER_FILE, stage_key, verify_files

log = logging.getLogger("remoe.data")

TOKENIZER_ALGO = "bytelevel-bpe/1"  # bump when the training recipe changes
MIN_FREQUENCY = 2


class Reporter:
    """The stages' progress lines: on stderr with progress on, else to the ``remoe.data`` log."""

    def __init__(self, enabled: bool, guard=None):
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.guard = guard  # called with what is about to change before any cache file is written

    def before_write(self, what: str) -> None:
        if self.guard is not None:
            self.guard(what)

    def say(self, msg: str) -> None:
        line = f"[remoe.data {time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
        else:  # no progress display: the stage lines still reach a caller's logging handler
            log.info(line)


def _describe_corpus_change(old: dict[str, Any], fps: dict[str, str]) -> str:
    old_fps = old.get("fingerprints") or {}
    changed = [d for d in sorted(fps) if d in old_fps and old_fps[d] != fps[d]]
    added = [d for d in sorted(fps) if d not in old_fps]
    removed = [d for d in sorted(old_fps) if d not in fps]
    parts = []
    if changed:
        parts.append("changed: " + ", ".join(changed))
    if added:
        parts.append("added: " + ", ".join(added))
    if removed:
        parts.append("removed: " + ", ".join(removed))
    return "; ".join(parts) if parts else "split fractions changed"


def corpus_stage(cfg: DataConfig, cache: Path, old: dict[str, Any] | None,
                  rep: Reporter) -> tuple[dict[str, Any], dict[str, list[Document]], Corpus]:
    rep.say(f"collecting corpus from {cfg.sources} (<= {cfg.max_bytes_per_domain:,} bytes/domain)")
    corpus = collect_corpus(cfg.sources, cfg.max_bytes_per_domain)
    fps = corpus.fingerprints()
    splits = assign_splits(corpus.docs, cfg.val_fraction, cfg.test_fraction)
    _check_splits(cfg, corpus, splits)
    key = stage_key({"format": FORMAT_VERSION, "fingerprints": fps, "val": cfg.val_fraction,
                "test": cfg.test_fraction})
    split_stats = {s: {} for s in SPLITS}
    for s, docs in splits.items():
        for d in docs:
            st = split_stats[s].setdefault(d.domain, {"docs": 0, "bytes": 0})
            st["docs"] += 1
            st["bytes"] += d.num_bytes
    if old and old.get("key") == key:
        problem = verify_files(cache, old.get("files") or {})
        if problem is None:
            rep.say("corpus unchanged: reusing corpus/*.jsonl")
            return old, splits, corpus
        rep.before_write("its corpus")
        log.warning("data cache %s: %s; rewriting the corpus files", cache, problem)
    elif old:
        rep.before_write("its corpus")
        log.warning("data cache %s: data sources changed (%s); rebuilding",
                    cache, _describe_corpus_change(old, fps))
    rep.before_write("its corpus")
    files = {}
    for s in SPLITS:
        rel = f"corpus/{s}.jsonl"
        write_documents(cache / rel, splits[s])
        files[rel] = {"sha256": sha256_file(cache / rel), "bytes": (cache / rel).stat().st_size}
    entry = {
        "key": key,
        "fingerprint": stage_key(fps),
        "fingerprints": fps,
        "domains": corpus.domains,
        "splits": split_stats,
        "files": files,
        "sources_used": corpus.sources_used,
        "sources_missing": corpus.sources_missing,
        "licences": corpus.licences,
    }
    return entry, splits, corpus


def _check_splits(cfg: DataConfig, corpus: Corpus, splits: dict[str, list[Document]]) -> None:
    """Refuse splits that training cannot use; warn (with counts) about thin ones."""
    n = sum(len(v) for v in corpus.docs.values())
    where = f"{n} document(s) in {len(corpus.docs)} domain(s) from {list(cfg.sources)}"
    if not splits["train"]:  # assign_splits gives every domain a train document
        raise DataError(f"the train split is empty ({where})")
    single = [d for d in corpus.domains if len(corpus.docs[d]) < 2]
    if not splits["validation"]:
        if cfg.val_fraction > 0:
            raise DataError(
                f"the validation split is empty: {where} are too few (a domain needs >= 2 "
                f"documents to give one to validation besides train): add documents (e.g. "
                f"split a large file into several) or use a source with more of them")
        log.warning("data.val_fraction=0: there is no validation split (`remoe train` needs one)")
    elif single and cfg.val_fraction > 0:
        log.warning("%d of %d domains have a single document, used for train only (no "
                    "validation loss for them): %s", len(single), len(corpus.docs),
                    ", ".join(single))
    if not splits["test"] and cfg.test_fraction > 0:
        log.warning("the test split is empty: %s are too few (a domain needs >= 3 documents "
                    "to give one to test)", where)


def _tokenizer_training_docs(train: list[Document], cap: int) -> list[Document]:
    """All train documents, or a deterministic per-domain subsample of about ``cap`` bytes."""
    total = sum(d.num_bytes for d in train)
    if cap <= 0 or total <= cap:
        return train
    by_dom: dict[str, list[Document]] = {}
    for d in train:
        by_dom.setdefault(d.domain, []).append(d)
    out = []
    for dom, docs in sorted(by_dom.items()):
        share = cap * sum(d.num_bytes for d in docs) // total
        used = 0
        for d in sorted(docs, key=lambda d: (stable_hash("tokenizer-sample", dom, d.key), d.key)):
            if used + d.num_bytes <= share:
                out.append(d)
                used += d.num_bytes
    out.sort(key=lambda d: (d.domain, d.key))
    return out


def tokenizer_stage(cfg: DataConfig, cache: Path, corpus_key: str, train: list[Document],
                     old: dict[str, Any] | None, rep: Reporter,
                     progress: bool) -> tuple[dict[str, Any], Tokenizer]:
    path = cache / TOKENIZER_FILE
    if cfg.tokenizer is not None:
        src = Path(cfg.tokenizer).resolve()
        tok = _tok.load_tokenizer(src)
        text = tok.to_str(pretty=True)
        sha = sha256_bytes(text.encode("utf-8"))
        if not (path.is_file() and sha256_file(path) == sha):
            rep.before_write("its tokenizer")
            _tok.save_tokenizer(tok, path)
        rep.say(f"using tokenizer {src}")
        key = stage_key({"file": sha})
        source = f"loaded from {src}"
    else:
        key = stage_key({"corpus": corpus_key, "vocab_size": cfg.vocab_size, "algo": TOKENIZER_ALGO,
                    "min_frequency": MIN_FREQUENCY, "train_bytes": cfg.tokenizer_train_bytes})
        source = f"trained (byte-level BPE, vocab {cfg.vocab_size})"
        tok = None
        if old and old.get("key") == key:
            if path.is_file() and sha256_file(path) == old.get("sha256"):
                tok = Tokenizer.from_file(str(path))
                rep.say("tokenizer unchanged: reusing tokenizer.json")
            else:
                rep.before_write("its tokenizer")
                log.warning("data cache %s: tokenizer.json is missing or does not match its "
                            "sha256; retraining", cache)
        elif old:
            rep.before_write(f"its tokenizer (vocab {cfg.vocab_size})")
            log.warning("data cache %s: tokenizer settings or training corpus changed; "
                        "retraining the tokenizer", cache)
        if tok is None:
            rep.before_write(f"its tokenizer (vocab {cfg.vocab_size})")
            docs = _tokenizer_training_docs(train, cfg.tokenizer_train_bytes)
            nbytes = sum(d.num_bytes for d in docs)
            rep.say(f"training byte-level BPE (vocab {cfg.vocab_size}) on {len(docs)} train "
                    f"documents ({nbytes:,} bytes)")
            batches = list(_tok.batched_texts(d.text for d in docs))
            tok = _tok.train_tokenizer(iter(batches), cfg.vocab_size,
                                       length=sum(map(len, batches)),  # texts: the bar's unit
                                       min_frequency=MIN_FREQUENCY, progress=progress)
            _tok.save_tokenizer(tok, path)
    eos = _tok.find_eos(tok)
    assert eos is not None  # load_tokenizer / train_tokenizer guarantee one
    entry = {
        "key": key,
        "sha256": sha256_file(path),
        "source": source,
        "vocab_size": _tok.tokenizer_vocab_size(tok),
        "eos_token": eos[0],
        "eos_id": eos[1],
    }
    return entry, tok


def tokens_stage(cache: Path, corpus_key: str, tok_entry: dict[str, Any], tok: Tokenizer,
                  splits: dict[str, list[Document]], domains: list[str],
                  old: dict[str, Any] | None, rep: Reporter,
                  progress: bool) -> dict[str, Any]:
    dtype = _store.token_dtype(tok_entry["vocab_size"])
    key = stage_key({"format": FORMAT_VERSION, "corpus": corpus_key, "tokenizer": tok_entry["sha256"],
                "dtype": dtype.name, "domains": domains})
    tok_dir = cache / "tokens"
    entries: dict[str, Any] = {}
    todo: list[str] = []
    if old and old.get("key") == key:
        for s in SPLITS:
            problem = _store.verify_split_files(tok_dir, s, (old.get("splits") or {}).get(s, {}))
            if problem is None:
                entries[s] = old["splits"][s]
            else:
                rep.before_write("its token arrays")
                log.warning("data cache %s: %s split: %s; re-tokenising it", cache, s, problem)
                todo.append(s)
        if not todo:
            rep.say("token arrays verified (sha256): reusing them")
    else:
        if old:
            rep.before_write("its token arrays")
            reason = ("the tokenizer changed" if old.get("tokenizer") != tok_entry["sha256"]
                      else "the corpus changed" if old.get("corpus") != corpus_key
                      else "the store format changed")
            log.warning("data cache %s: token arrays are stale (%s); re-tokenising", cache, reason)
        todo = list(SPLITS)
    if todo:
        rep.before_write("its token arrays")
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in encode(texts, add_special_tokens=False)]

        total = sum(len(d.text) for s in todo for d in splits[s])
        rep.say(f"tokenising {', '.join(todo)} ({total:,} characters)")
        bar = None
        if progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenising",
                           file=sys.stderr, leave=False)
            except ImportError:  # pragma: no cover
                bar = None
        try:
            for s in todo:
                entries[s] = _store.build_split_store(
                    tok_dir, s, splits[s], domains, encode_batch, tok_entry["eos_id"], dtype,
                    progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
    return {"key": key, "corpus": corpus_key, "tokenizer": tok_entry["sha256"],
            "dtype": dtype.name, "splits": {s: entries[s] for s in SPLITS}}
