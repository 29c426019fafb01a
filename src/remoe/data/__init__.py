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

_LAZY = {
    "BUILTIN_DOMAINS": "remoe.data.builtin", "BUILTIN_SOURCES": "remoe.data.builtin",
    "read_austen_books": "remoe.data.builtin",
    "DEFAULT_CACHE_DIR": "remoe.data.config", "DataConfig": "remoe.data.config",
    "assign_splits": "remoe.data.corpus", "iter_documents": "remoe.data.corpus",
    "parse_source": "remoe.data.corpus", "split_unit": "remoe.data.corpus",
    "write_documents": "remoe.data.corpus",
    "SPLITS": "remoe.data.documents", "Document": "remoe.data.documents",
    "DataBundle": "remoe.data.pipeline", "load_documents": "remoe.data.pipeline",
    "load_prepared": "remoe.data.pipeline", "prepare_data": "remoe.data.pipeline",
    "read_lazyload_db": "remoe.data.rfiles", "read_rds": "remoe.data.rfiles",
    "RFormatError": "remoe.data.rserialize", "RObject": "remoe.data.rserialize",
    "unserialize": "remoe.data.rserialize",
    "TrainBatches": "remoe.data.sampler", "eval_batches": "remoe.data.sampler",
    "Batch": "remoe.data.store", "ChunkTable": "remoe.data.store",
    "EOS_TOKEN": "remoe.data.tokenizer", "load_hf_tokenizer": "remoe.data.tokenizer",
    "load_tokenizer": "remoe.data.tokenizer", "save_tokenizer": "remoe.data.tokenizer",
    "train_tokenizer": "remoe.data.tokenizer",
    "read_jsonl": "remoe.data.userdata", "read_user_source": "remoe.data.userdata",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)

__all__ = sorted(_LAZY)
