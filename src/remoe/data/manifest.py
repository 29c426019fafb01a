"""The data cache's ``manifest.json``: stage keys, structure check and file verification.

The manifest records, per stage (corpus, tokenizer, tokens), a key (a sha256 of everything
the stage depends on) and the size and sha256 of every file the stage wrote; see
:mod:`remoe.data.pipeline` for the cache layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remoe.data import store as _store
from remoe.data._io import read_json, sha256_bytes, sha256_file
from remoe.data.documents import SPLITS

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"


def stage_key(obj: Any) -> str:
    """A stage's key: the sha256 of the canonical JSON of what the stage depends on."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def verify_files(cache: Path, files: dict[str, Any]) -> str | None:
    """None when every file matches its recorded size and sha256; otherwise why not."""
    for rel, meta in sorted(files.items()):
        p = cache / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta.get("bytes"):
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta.get('bytes')}"
        if sha256_file(p) != meta.get("sha256"):
            return f"{rel} does not match its sha256 (corrupt)"
    return None


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


def read_manifest(cache: Path) -> tuple[dict[str, Any] | None, str | None]:
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
