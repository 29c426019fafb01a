"""Data pipeline of remoe: multi-domain corpus, splits, tokenizer, packed token stores, samplers.

Entry point: :func:`prepare_data` with a :class:`DataConfig` builds (or reuses) the sharded
token store and returns a :class:`DataBundle` (tokenizer, domains, each split's
:class:`~remoe.data.shardstore.ShardedStore`, resumable :class:`TrainBatches`, evaluation
batches and raw held-out documents). See ``docs/DATA.md``.
"""

from remoe.data.builtin import BUILTIN_DOMAINS, BUILTIN_SOURCES, read_austen_books
from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.data.corpus import (Corpus, assign_splits, collect_corpus, iter_documents, parse_source,
                               split_unit, write_documents)
from remoe.data.documents import SPLITS, Document
from remoe.data.pipeline import DataBundle, load_documents, load_prepared, prepare_data
from remoe.data.rfiles import read_lazyload_db, read_rds
from remoe.data.rserialize import RFormatError, RObject, unserialize
from remoe.data.sampler import TrainBatches, eval_batches
from remoe.data.store import Batch, ChunkTable
from remoe.data.tokenizer import (EOS_TOKEN, load_hf_tokenizer, load_tokenizer, save_tokenizer,
                                  train_tokenizer)
from remoe.data.userdata import read_jsonl, read_user_source

__all__ = [
    "BUILTIN_DOMAINS", "BUILTIN_SOURCES", "Batch", "ChunkTable", "Corpus", "DEFAULT_CACHE_DIR",
    "DataBundle", "DataConfig", "Document", "EOS_TOKEN", "RFormatError", "RObject", "SPLITS",
    "TrainBatches", "assign_splits", "collect_corpus", "eval_batches", "iter_documents",
    "load_documents", "load_hf_tokenizer", "load_prepared", "load_tokenizer",
    "parse_source", "prepare_data", "read_austen_books", "read_jsonl", "read_lazyload_db",
    "read_rds", "read_user_source", "save_tokenizer", "split_unit", "train_tokenizer",
    "unserialize", "write_documents",
]
