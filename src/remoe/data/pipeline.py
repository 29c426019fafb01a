"""``prepare_data``: corpus -> splits -> tokenizer -> token stores, cached with a manifest.

Cache layout (``DataConfig.cache_dir``)::

    manifest.json            format version, config, fingerprints, sizes, sha256 of every file
    corpus/{split}.jsonl     the split's documents (Pile format, meta.pile_set_name = domain)
    tokenizer.json           the tokenizer used for the token arrays
    tokens/{split}.*.npy     packed token arrays (see remoe.data.store)

Each stage has a key (a sha256 of everything it depends on) recorded in the manifest:

* corpus:    fingerprints of the collected documents (sha256 of their keys and texts per
  domain) + split fractions. The sources are read on every call (about a second for the
  built-in corpus) to compute these: a changed source is always noticed.
* tokenizer: the corpus key + vocabulary size (trained) or the loaded file's content.
* tokens:    the corpus key + the sha256 of ``tokenizer.json``.

A stage whose key matches and whose files match their recorded sizes and sha256 is reused as
is (no re-tokenisation); otherwise a warning says why and it is rebuilt. All files are written
to a temporary name and moved into place, and the manifest last, so an interrupted build is
never mistaken for a finished one. A file lock serialises concurrent builds (e.g. several ranks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tokenizers import Tokenizer

from remoe.data import store as _store
from remoe.data import tokenizer as _tok
from remoe.data._io import atomic_write_json, read_json, sha256_bytes, sha256_file, stable_hash
from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.data.corpus import Corpus, assign_splits, collect_corpus, iter_documents, write_documents
from remoe.data.documents import SPLITS, Document
from remoe.data.errors import DataError, DataNotFoundError
from remoe.data.sampler import TrainBatches, eval_batches
from remoe.data.store import Batch, TokenStore

log = logging.getLogger("remoe.data")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_ALGO = "bytelevel-bpe/1"  # bump when the training recipe changes
MIN_FREQUENCY = 2


def _key(obj: Any) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))


LOCK_FILE = ".lock"
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _lock_holder(fd: int) -> str:
    """The PID the lock holder wrote into the lock file ("?" if none yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "?"


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[bool]:
    """Hold the cache's lock while building or verifying; yields whether the cache is writable.

    A writable cache is locked exclusively and the holder's PID written into ``.lock``; a
    process that has to wait says so at once, naming that PID. A read-only cache (read-only
    file system or no write permission) is only read: a shared lock on an existing ``.lock``
    opened read-only, or no lock at all when there is none.
    """
    path = cache / LOCK_FILE
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+b")
        writable = True
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
        writable = False
        try:
            fh = open(path, "rb")
        except OSError:
            fh = None
    if fh is None:
        log.info("data cache %s is read-only and has no lock file: reading it unlocked", cache)
        yield False
        return
    with fh:
        mode = fcntl.LOCK_EX if writable else fcntl.LOCK_SH
        try:
            fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for the lock held by PID %s on %s", _lock_holder(fh.fileno()),
                        path)
            fcntl.flock(fh.fileno(), mode)
        try:
            if writable:
                fh.truncate(0)
                fh.write(f"{os.getpid()}\n".encode("ascii"))
                fh.flush()
            yield writable
        finally:
            if writable:
                with contextlib.suppress(OSError):
                    fh.truncate(0)
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class _Reporter:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def say(self, msg: str) -> None:
        line = f"[remoe.data {time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
        else:  # no progress display: the stage lines still reach a caller's logging handler
            log.info(line)


# -- bundle -------------------------------------------------------------------------------------


@dataclass
class DataBundle:
    """The prepared data: tokenizer, domains, token stores and documents of each split."""

    cache_dir: Path
    tokenizer: Tokenizer = field(repr=False)
    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    eos_token: str
    domains: list[str]
    manifest: dict[str, Any] = field(repr=False)
    seed: int = 0
    _stores: dict[str, TokenStore] = field(default_factory=dict, repr=False)

    def split(self, name: str) -> TokenStore:
        """The token store of ``train``, ``validation`` or ``test``."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        if name not in self._stores:
            self._stores[name] = TokenStore(self.cache_dir / "tokens", name, self.domains)
        return self._stores[name]

    def train_batches(self, seq_len: int, micro_batch: int, grad_accum: int = 1,
                      world_size: int = 1, seed: int | None = None, *,
                      require_validation: bool = True) -> TrainBatches:
        """A :class:`TrainBatches` sampler over the train split (``seed`` defaults to the
        config's).

        Training evaluates on the validation split, so by default this also checks that
        validation has at least one chunk of ``seq_len + 1`` tokens (:meth:`check_eval_split`):
        a run that cannot measure its validation loss fails here, before any model work,
        instead of writing a NaN ``val_loss`` at its end.
        """
        sampler = TrainBatches(self.split("train"), seq_len, micro_batch, grad_accum, world_size,
                               self.seed if seed is None else seed)
        if require_validation:
            self.check_eval_split("validation", seq_len)
        return sampler

    def check_eval_split(self, split: str, seq_len: int) -> None:
        """Raise :class:`DataError` if ``split`` has no chunk of ``seq_len + 1`` tokens; warn
        (with counts) about domains that have none and so are not evaluated."""
        store = self.split(split)
        table = store.chunks(seq_len)
        if len(table) == 0:
            raise DataError(
                f"the {split} split has no chunk of {seq_len + 1} tokens ({store.num_docs} "
                f"documents, {store.num_tokens} tokens, per domain "
                f"{store.tokens_per_domain() or '{}'}), so no {split} loss can be measured: use "
                f"a shorter train.seq_len, more or longer documents, or a larger "
                f"data.val_fraction")
        present = set(table.domain_ids.tolist())
        missing = [d for i, d in enumerate(store.domains) if i not in present]
        if missing:
            log.warning("the %s split has no chunk of %d tokens in %d of %d domains (%s): "
                        "they are not evaluated", split, seq_len + 1, len(missing),
                        len(store.domains), ", ".join(missing))

    def eval_batches(self, split: str, seq_len: int, batch_size: int,
                     max_chunks_per_domain: int | None = None) -> Iterator[Batch]:
        """Deterministic batches of ``split`` with every domain represented."""
        return eval_batches(self.split(split), seq_len, batch_size, max_chunks_per_domain)

    def documents(self, split: str, domain: str | None = None) -> list[Document]:
        """The raw documents of ``split`` (optionally one domain), in store order."""
        return load_documents(split, domain, cache_dir=self.cache_dir)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def hf_tokenizer(self):
        """A ``transformers.PreTrainedTokenizerFast`` for this tokenizer."""
        return _tok.load_hf_tokenizer(self.tokenizer_path)

    def summary(self) -> str:
        """Documents and tokens per domain per split, as a small table."""
        splits = self.manifest["tokens"]["splits"]
        corpus = self.manifest["corpus"]["splits"]
        w = max([len(d) for d in self.domains] + [len("domain"), len("total")])
        head = f"{'domain':<{w}}  {'bytes':>11}" + "".join(
            f"  {s + ' docs':>15} {s + ' tokens':>17}" for s in SPLITS)
        lines = [
            f"data cache {self.cache_dir}: {len(self.domains)} domains, tokenizer "
            f"{self.tokenizer_path.name} (vocab {self.vocab_size}, eos {self.eos_token!r}="
            f"{self.eos_id}, {self.manifest['tokenizer']['source']})",
            head,
            "-" * len(head),
        ]
        tot_bytes = 0
        tot = {s: [0, 0] for s in SPLITS}
        for dom in self.domains + ["total"]:
            if dom == "total":
                lines.append("-" * len(head))
                nbytes = tot_bytes
                cells = [tuple(tot[s]) for s in SPLITS]
            else:
                nbytes = sum(corpus[s].get(dom, {}).get("bytes", 0) for s in SPLITS)
                tot_bytes += nbytes
                cells = []
                for s in SPLITS:
                    nd = splits[s]["docs_per_domain"].get(dom, 0)
                    nt = splits[s]["tokens_per_domain"].get(dom, 0)
                    tot[s][0] += nd
                    tot[s][1] += nt
                    cells.append((nd, nt))
            lines.append(f"{dom:<{w}}  {nbytes:>11,}" + "".join(
                f"  {nd:>15,} {nt:>17,}" for nd, nt in cells))
        return "\n".join(lines)


# -- stages -------------------------------------------------------------------------------------


def _verify_files(cache: Path, files: dict[str, Any]) -> str | None:
    for rel, meta in sorted(files.items()):
        p = cache / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta.get("bytes"):
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta.get('bytes')}"
        if sha256_file(p) != meta.get("sha256"):
            return f"{rel} does not match its sha256 (corrupt)"
    return None


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


def _corpus_stage(cfg: DataConfig, cache: Path, old: dict[str, Any] | None,
                  rep: _Reporter) -> tuple[dict[str, Any], dict[str, list[Document]], Corpus]:
    rep.say(f"collecting corpus from {cfg.sources} (<= {cfg.max_bytes_per_domain:,} bytes/domain)")
    corpus = collect_corpus(cfg.sources, cfg.max_bytes_per_domain)
    fps = corpus.fingerprints()
    splits = assign_splits(corpus.docs, cfg.val_fraction, cfg.test_fraction)
    _check_splits(cfg, corpus, splits)
    key = _key({"format": FORMAT_VERSION, "fingerprints": fps, "val": cfg.val_fraction,
                "test": cfg.test_fraction})
    split_stats = {s: {} for s in SPLITS}
    for s, docs in splits.items():
        for d in docs:
            st = split_stats[s].setdefault(d.domain, {"docs": 0, "bytes": 0})
            st["docs"] += 1
            st["bytes"] += d.num_bytes
    if old and old.get("key") == key:
        problem = _verify_files(cache, old.get("files") or {})
        if problem is None:
            rep.say("corpus unchanged: reusing corpus/*.jsonl")
            return old, splits, corpus
        log.warning("data cache %s: %s; rewriting the corpus files", cache, problem)
    elif old:
        log.warning("data cache %s: data sources changed (%s); rebuilding",
                    cache, _describe_corpus_change(old, fps))
    files = {}
    for s in SPLITS:
        rel = f"corpus/{s}.jsonl"
        write_documents(cache / rel, splits[s])
        files[rel] = {"sha256": sha256_file(cache / rel), "bytes": (cache / rel).stat().st_size}
    entry = {
        "key": key,
        "fingerprint": _key(fps),
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


def _tokenizer_stage(cfg: DataConfig, cache: Path, corpus_key: str, train: list[Document],
                     old: dict[str, Any] | None, rep: _Reporter,
                     progress: bool) -> tuple[dict[str, Any], Tokenizer]:
    path = cache / TOKENIZER_FILE
    if cfg.tokenizer is not None:
        src = Path(cfg.tokenizer).resolve()
        tok = _tok.load_tokenizer(src)
        text = tok.to_str(pretty=True)
        sha = sha256_bytes(text.encode("utf-8"))
        if not (path.is_file() and sha256_file(path) == sha):
            _tok.save_tokenizer(tok, path)
        rep.say(f"using tokenizer {src}")
        key = _key({"file": sha})
        source = f"loaded from {src}"
    else:
        key = _key({"corpus": corpus_key, "vocab_size": cfg.vocab_size, "algo": TOKENIZER_ALGO,
                    "min_frequency": MIN_FREQUENCY, "train_bytes": cfg.tokenizer_train_bytes})
        source = f"trained (byte-level BPE, vocab {cfg.vocab_size})"
        tok = None
        if old and old.get("key") == key:
            if path.is_file() and sha256_file(path) == old.get("sha256"):
                tok = Tokenizer.from_file(str(path))
                rep.say("tokenizer unchanged: reusing tokenizer.json")
            else:
                log.warning("data cache %s: tokenizer.json is missing or does not match its "
                            "sha256; retraining", cache)
        elif old:
            log.warning("data cache %s: tokenizer settings or training corpus changed; "
                        "retraining the tokenizer", cache)
        if tok is None:
            docs = _tokenizer_training_docs(train, cfg.tokenizer_train_bytes)
            nbytes = sum(d.num_bytes for d in docs)
            rep.say(f"training byte-level BPE (vocab {cfg.vocab_size}) on {len(docs)} train "
                    f"documents ({nbytes:,} bytes)")
            batches = list(_tok.batched_texts(d.text for d in docs))
            tok = _tok.train_tokenizer(iter(batches), cfg.vocab_size, length=len(batches),
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


def _tokens_stage(cache: Path, corpus_key: str, tok_entry: dict[str, Any], tok: Tokenizer,
                  splits: dict[str, list[Document]], domains: list[str],
                  old: dict[str, Any] | None, rep: _Reporter,
                  progress: bool) -> dict[str, Any]:
    dtype = _store.token_dtype(tok_entry["vocab_size"])
    key = _key({"format": FORMAT_VERSION, "corpus": corpus_key, "tokenizer": tok_entry["sha256"],
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
                log.warning("data cache %s: %s split: %s; re-tokenising it", cache, s, problem)
                todo.append(s)
        if not todo:
            rep.say("token arrays verified (sha256): reusing them")
    else:
        if old:
            reason = ("the tokenizer changed" if old.get("tokenizer") != tok_entry["sha256"]
                      else "the corpus changed" if old.get("corpus") != corpus_key
                      else "the store format changed")
            log.warning("data cache %s: token arrays are stale (%s); re-tokenising", cache, reason)
        todo = list(SPLITS)
    if todo:
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


def _is_file_entry(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("sha256"), str)
            and isinstance(v.get("bytes"), int) and not isinstance(v.get("bytes"), bool))


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def manifest_problem(m: Any) -> str | None:
    """What is malformed in a parsed ``manifest.json`` (None if its structure is sound).

    Only the structure is checked here (every field the pipeline reads has the right type);
    whether the files match it is checked against their sizes and sha256 afterwards. The
    ``tokenizer`` and ``tokens`` entries may be missing (a build interrupted after the corpus).
    """
    if not isinstance(m, dict):
        return f"it is a JSON {type(m).__name__}, not an object"
    if m.get("format_version") != FORMAT_VERSION:
        return f"format version {m.get('format_version')!r} (expected {FORMAT_VERSION})"
    if not _is_str_list(m.get("domains")):
        return "'domains' is not a list of names"
    c = m.get("corpus")
    if not isinstance(c, dict):
        return "'corpus' is not an object"
    if not isinstance(c.get("key"), str) or not _is_str_list(c.get("domains")):
        return "'corpus' has no key or domain list"
    if not isinstance(c.get("fingerprints"), dict):
        return "'corpus.fingerprints' is not an object"
    if not isinstance(c.get("files"), dict) or not all(
            _is_file_entry(v) for v in c["files"].values()):
        return "'corpus.files' is not a map of {sha256, bytes}"
    cs = c.get("splits")
    if not isinstance(cs, dict) or not all(isinstance(cs.get(x), dict) for x in SPLITS):
        return "'corpus.splits' does not have the three splits"
    t = m.get("tokenizer")
    if t is not None:
        if not isinstance(t, dict) or not all(isinstance(t.get(k), str) for k in (
                "key", "sha256", "source", "eos_token")) or not all(
                isinstance(t.get(k), int) and not isinstance(t.get(k), bool)
                for k in ("vocab_size", "eos_id")):
            return "'tokenizer' does not have key, sha256, source, vocab_size, eos_token, eos_id"
    k = m.get("tokens")
    if k is not None:
        if t is None:
            return "'tokens' without 'tokenizer'"
        if not isinstance(k, dict) or not all(isinstance(k.get(x), str) for x in (
                "key", "corpus", "tokenizer")):
            return "'tokens' does not have key, corpus and tokenizer"
        ks = k.get("splits")
        if not isinstance(ks, dict):
            return "'tokens.splits' is not an object"
        for x in SPLITS:
            e = ks.get(x)
            if not isinstance(e, dict) or not isinstance(e.get("files"), dict) or not all(
                    _is_file_entry(e["files"].get(w)) for w in _store.TOKEN_FILES):
                return f"'tokens.splits.{x}' does not list its three files"
            if not isinstance(e.get("docs_per_domain"), dict) or not isinstance(
                    e.get("tokens_per_domain"), dict):
                return f"'tokens.splits.{x}' has no per-domain sizes"
    return None


def _read_manifest(cache: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` or ``(None, why it cannot be used)``; (None, None) if absent."""
    path = cache / MANIFEST
    if not path.exists():
        return None, None
    m = read_json(path)
    if m is None:
        return None, "manifest.json is not readable JSON"
    if isinstance(m, dict) and m.get("format_version") != FORMAT_VERSION:
        return None, (f"manifest.json has format version {m.get('format_version')!r} "
                      f"(expected {FORMAT_VERSION})")
    problem = manifest_problem(m)
    if problem is not None:
        return None, f"manifest.json is malformed ({problem})"
    return m, None


def _not_writable(cache: Path, e: OSError) -> DataError:
    where = f"{e.strerror or e}: {e.filename}" if e.filename else f"{e.strerror or e}"
    if e.errno == errno.ENOSPC:
        return DataError(f"disk full while writing the data cache {cache} ({where}); free "
                         "space or set data.cache_dir to another disk")
    return DataError(f"data cache {cache} must be (re)built but is not writable ({where}): "
                     "make it writable, run `remoe data` where it is, or set data.cache_dir "
                     "to a writable directory")


def prepare_data(cfg: DataConfig | None = None, *, progress: bool = True) -> DataBundle:
    """Build (or reuse from ``cfg.cache_dir``) the corpus, tokenizer and token stores.

    Raises :class:`DataError` (a one-line ``ConfigError``) when the input cannot give usable
    data: no documents, a corrupt or binary source file, an empty train or validation split,
    or a cache that needs building but is read-only (a complete one is read without writing).
    """
    cfg = (cfg or DataConfig()).validate()
    cache = Path(cfg.cache_dir)
    rep = _Reporter(progress)
    with _locked(cache):
        try:
            return _prepare_locked(cfg, cache, rep, progress)
        except OSError as e:
            if isinstance(e, DataError) or e.errno not in _NOT_WRITABLE + (errno.ENOSPC,):
                raise
            in_cache = e.filename is None or Path(os.path.abspath(e.filename)).is_relative_to(
                Path(os.path.abspath(cache)))
            if not in_cache and e.errno != errno.ENOSPC:
                raise  # e.g. an unreadable source file: not the cache's fault
            raise _not_writable(cache, e) from None


def _prepare_locked(cfg: DataConfig, cache: Path, rep: _Reporter, progress: bool) -> DataBundle:
    manifest, why = _read_manifest(cache)
    if why is not None:
        log.warning("data cache %s: %s; treating the cache as corrupt and rebuilding it",
                    cache, why)
    elif manifest is None and (cache / "tokens").exists():
        log.warning("data cache %s has files but no manifest; rebuilding", cache)
    old = manifest or {}

    corpus_entry, splits, corpus = _corpus_stage(cfg, cache, old.get("corpus"), rep)
    domains = corpus_entry["domains"]
    new: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "config": {"sources": list(cfg.sources), "max_bytes_per_domain":
                   cfg.max_bytes_per_domain, "val_fraction": cfg.val_fraction,
                   "test_fraction": cfg.test_fraction, "vocab_size": cfg.vocab_size,
                   "tokenizer": cfg.tokenizer,
                   "tokenizer_train_bytes": cfg.tokenizer_train_bytes},
        "domains": domains,
        "corpus": corpus_entry,
    }
    if old.get("corpus") != corpus_entry:
        # the old tokenizer/token entries describe another corpus: drop them before the
        # corpus files they do not match are recorded
        atomic_write_json(cache / MANIFEST, new)

    tok_entry, tok = _tokenizer_stage(cfg, cache, corpus_entry["key"], splits["train"],
                                      old.get("tokenizer"), rep, progress)
    new["tokenizer"] = tok_entry
    tokens_entry = _tokens_stage(cache, corpus_entry["key"], tok_entry, tok, splits, domains,
                                 old.get("tokens"), rep, progress)
    new["tokens"] = tokens_entry
    if new != manifest:
        atomic_write_json(cache / MANIFEST, new)
    rep.say("data ready")
    return _bundle(cache, new, tok, cfg.seed)


def _bundle(cache: Path, manifest: dict[str, Any], tok: Tokenizer, seed: int) -> DataBundle:
    t = manifest["tokenizer"]
    return DataBundle(cache_dir=cache, tokenizer=tok, tokenizer_path=cache / TOKENIZER_FILE,
                      vocab_size=int(t["vocab_size"]), eos_id=int(t["eos_id"]),
                      eos_token=t["eos_token"], domains=list(manifest["domains"]),
                      manifest=manifest, seed=seed)


def load_prepared(cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR, *, verify: bool = True,
                  seed: int = 0) -> DataBundle:
    """Open a cache built by :func:`prepare_data` without reading the sources.

    With ``verify`` (default) every file is checked against the sha256 in the manifest;
    without it only existence and sizes are. Raises FileNotFoundError (also a DataError) if
    the cache is incomplete or its manifest malformed, ValueError if a file is corrupt (run
    ``prepare_data`` / ``remoe data`` to rebuild it).
    """
    cache = Path(cache_dir)
    manifest, why = _read_manifest(cache)
    if manifest is None or "tokens" not in manifest:
        raise DataNotFoundError(f"no complete data cache in {cache}"
                                f"{' (' + why + ')' if why else ''} (run `remoe data`)")
    tok_path = cache / TOKENIZER_FILE
    files = dict(manifest["corpus"]["files"])
    files[TOKENIZER_FILE] = {"sha256": manifest["tokenizer"]["sha256"],
                             "bytes": tok_path.stat().st_size if tok_path.is_file() else -1}
    for s in SPLITS:
        for what, meta in manifest["tokens"]["splits"][s]["files"].items():
            files[f"tokens/{s}.{what}.npy"] = meta
    if verify:
        problem = _verify_files(cache, files)
    else:
        problem = None
        for rel, meta in sorted(files.items()):
            p = cache / rel
            if rel != TOKENIZER_FILE and (not p.is_file() or p.stat().st_size != meta["bytes"]):
                problem = f"{rel} is missing or truncated"
                break
    if problem is not None:
        raise ValueError(f"data cache {cache} is corrupt: {problem} (run `remoe data` to rebuild)")
    return _bundle(cache, manifest, Tokenizer.from_file(str(tok_path)), seed)


def load_documents(split: str, domain: str | None = None, *,
                   cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> list[Document]:
    """The raw documents of ``split`` from a prepared cache (optionally only ``domain``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    path = Path(cache_dir) / "corpus" / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (run `remoe data` first)")
    return list(iter_documents(path, domain))


def tokens_fingerprint(arr: np.ndarray) -> str:
    """sha256 of an array's bytes (handy to compare stores in tests and tools)."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
