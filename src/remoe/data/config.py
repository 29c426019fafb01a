"""``DataConfig``: everything that decides what ``prepare_data`` builds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError

DEFAULT_CACHE_DIR = ".remoe_cache/data"
DEFAULT_TOKENIZER_TRAIN_BYTES = 1_000_000_000  # what tokenizer_train_bytes=0 caps the sample at


@dataclass
class DataConfig:
    """Data pipeline configuration (the ``data:`` section of a run config).

    * ``sources`` -- source specs: ``builtin``, ``builtin:code,prose``, a path to a ``.txt`` /
      ``.jsonl`` / ``.jsonl.zst`` file or directory, or ``NAME=PATH`` to name its domain.
    * ``cache_dir`` -- where the sharded token store (``store-v2/``: tokenizer, token
      shards, index, held-out text, ``manifest.json``) and its lock live.
    * ``vocab_size`` -- BPE vocabulary size to train (ignored when ``tokenizer`` is given).
    * ``tokenizer`` -- path to an existing ``tokenizer.json`` (or its directory) or to a
      GPT-2 ``vocab.json`` (+ ``merges.txt`` beside it) instead of training one.
    * ``max_bytes_per_domain`` -- byte budget of each domain (UTF-8 bytes of document text);
      the default gives about 50 MB for the five built-in domains.
    * ``val_fraction`` / ``test_fraction`` -- expected share of documents held out per
      domain (a domain with >= 3 documents always gets at least one of each).
    * ``seed`` -- default seed of the training sampler (splits do not depend on it).
    * ``tokenizer_train_bytes`` -- train the BPE on at most this many bytes of the train
      split (a deterministic per-domain subsample); 0 = the whole train split up to
      ``DEFAULT_TOKENIZER_TRAIN_BYTES`` (1 GB), sampled the same way beyond it, so that the
      trainer's memory (it counts every distinct word) does not grow with the corpus.
    """

    sources: list[str] = field(default_factory=lambda: ["builtin"])
    cache_dir: str = DEFAULT_CACHE_DIR
    vocab_size: int = 8192
    tokenizer: str | None = None
    max_bytes_per_domain: int = 12_000_000
    val_fraction: float = 0.03
    test_fraction: float = 0.03
    seed: int = 0
    tokenizer_train_bytes: int = 0

    def validate(self) -> "DataConfig":
        """Raise :class:`remoe.errors.ConfigError` naming the first bad field; returns self."""
        from remoe.data.corpus import parse_source

        if isinstance(self.sources, str) or not isinstance(self.sources, (list, tuple)):
            raise ConfigError(f"data.sources={self.sources!r} must be a list of source specs")
        if not self.sources:
            raise ConfigError("data.sources=[] must name at least one source (e.g. 'builtin')")
        for i, spec in enumerate(self.sources):
            if not isinstance(spec, str):
                raise ConfigError(f"data.sources[{i}]={spec!r} must be a string")
            try:
                parsed = parse_source(spec)
            except ValueError as e:
                raise ConfigError(f"data.sources[{i}]={spec!r}: {e}") from None
            if parsed.kind == "path":
                p = Path(str(parsed.path))
                from remoe.data.megatron import megatron_prefix

                if not p.exists() and megatron_prefix(str(p)) is None:
                    why = ("is a symbolic link that leads nowhere (dangling or a loop)"
                           if p.is_symlink() else "does not exist")
                    raise ConfigError(f"data.sources[{i}]={spec!r} {why}")
                if p.exists() and not (p.is_file() or p.is_dir()):  # reading a FIFO hangs, a device never ends
                    raise ConfigError(f"data.sources[{i}]={spec!r} is neither a regular file "
                                      "nor a directory (a FIFO, socket or device)")
        if not isinstance(self.cache_dir, (str, Path)) or not str(self.cache_dir) or (
                "\x00" in str(self.cache_dir)):
            raise ConfigError(f"data.cache_dir={self.cache_dir!r} must be a non-empty path")
        cache = Path(self.cache_dir)
        for p in (cache, *cache.parents):  # the nearest existing ancestor must be a directory
            if p.exists():
                if not p.is_dir():
                    raise ConfigError(f"data.cache_dir={str(self.cache_dir)!r} must be a "
                                      f"directory, but {str(p)!r} is a file")
                break
        _int_at_least("vocab_size", self.vocab_size, 256)
        if self.vocab_size > 1 << 32:
            raise ConfigError(f"data.vocab_size={self.vocab_size} must be <= {1 << 32}")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, Path)) or not str(self.tokenizer):
                raise ConfigError(f"data.tokenizer={self.tokenizer!r} must be a path or null")
            if not Path(self.tokenizer).exists():
                raise ConfigError(f"data.tokenizer={str(self.tokenizer)!r} does not exist")
        _int_at_least("max_bytes_per_domain", self.max_bytes_per_domain, 1)
        for name in ("val_fraction", "test_fraction"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or not 0.0 <= v < 0.5):
                raise ConfigError(f"data.{name}={v!r} must be a number in [0, 0.5)")
        _int_at_least("seed", self.seed, 0)
        _int_at_least("tokenizer_train_bytes", self.tokenizer_train_bytes, 0)
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "DataConfig":
        """Build from a mapping (e.g. a YAML ``data:`` section); unknown keys are errors."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in names:
                known = ", ".join(sorted(names))
                raise ConfigError(f"data.{k} is not a data option (known: {known})")
        if isinstance(d.get("sources"), str):
            d["sources"] = [d["sources"]]
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _int_at_least(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"data.{name}={v!r} must be an integer")
    if v < lo:
        raise ConfigError(f"data.{name}={v} must be >= {lo}")
