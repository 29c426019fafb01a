"""Data pipeline of remoe: multi-domain corpus, splits, tokenizer, packed token stores, samplers.

Entry point: :func:`prepare_data` with a :class:`DataConfig` builds (or reuses) the sharded
token store and returns a :class:`DataBundle` (tokenizer, domains, each split's
:class:`~remoe.data.shardstore.ShardedStore`, resumable :class:`TrainBatches`, evaluation
batches and raw held-out documents). See ``docs/DATA.md``.

Light to import (PEP 562, as :mod:`remoe.model`): ``remoe.data.config`` is read by
:mod:`remoe.experiment` without numpy or tokenizers; the names below load on first use.
"""

from __future__ import annotations

from remoe.lazy import lazy_names

#: module -> the public names it gives (loaded on first use)
_MODULES = {
    "builtin": "BUILTIN_DOMAINS BUILTIN_SOURCES read_austen_books",
    "config": "DEFAULT_CACHE_DIR DataConfig",
    "corpus": "assign_splits iter_documents parse_source split_unit",
    "documents": "SPLITS Document",
    "pipeline": "DataBundle load_documents load_prepared prepare_data",
    "rserialize": "RFormatError RObject read_lazyload_db read_rds unserialize",
    "sampler": "TrainBatches eval_batches",
    "shardstore": "Batch ChunkTable",
    "tokenizer": "EOS_TOKEN load_hf_tokenizer load_tokenizer save_tokenizer train_tokenizer",
    "userdata": "read_jsonl read_user_source",
}
_LAZY = {name: f"remoe.data.{module}" for module, names in _MODULES.items()
         for name in names.split()}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
