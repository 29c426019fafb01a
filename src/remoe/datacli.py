"""``remoe data``: build (or verify) the corpus, tokenizer and token cache, print a summary.

A command above ``remoe.experiment`` (``remoe data CONFIG`` reads an experiment's data
section), so it lives beside ``remoe/cli.py``, not inside the ``data`` package it drives.

``remoe data CONFIG [--set data.x=v ...]`` takes the experiment config ``remoe train CONFIG``
takes, with the same overrides, and builds exactly the cache training will use (its ``data:``
section, ``cache_dir`` resolved from the working directory as training does). Without a
config, the options below describe the data (default: the built-in corpus).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from remoe.configfile import config_path
from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.errors import ConfigError
from remoe.experiment import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``remoe data`` options to ``parser``."""
    d = DataConfig()
    parser.add_argument("config", nargs="?", default=None,
                        help="experiment YAML, as for `remoe train CONFIG`: build the cache its "
                             "data section names (then use --set, not the options below)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field, as for `remoe "
                        "train` (e.g. --set data.vocab_size=4096); implies the default "
                        "experiment config when CONFIG is not given")
    parser.add_argument("--source", action="append", dest="sources", metavar="SPEC",
                        help="data source (repeatable): 'builtin', 'builtin:code,prose', a "
                             ".txt/.jsonl/.jsonl.zst file or directory, or NAME=PATH "
                             "(default: builtin)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache directory (default: {DEFAULT_CACHE_DIR})")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"BPE vocabulary size to train (default: {d.vocab_size})")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="use this tokenizer.json or GPT-2 vocab.json (+merges.txt) instead "
                             "of training one")
    parser.add_argument("--max-bytes-per-domain", type=int, default=None,
                        help=f"byte budget per domain (default: {d.max_bytes_per_domain:,})")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help=f"validation share of documents (default: {d.val_fraction})")
    parser.add_argument("--test-fraction", type=float, default=None,
                        help=f"test share of documents (default: {d.test_fraction})")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenise on N cores (default: the cores this process may use)")
    parser.add_argument("--shard-bytes", type=int, default=None, metavar="B",
                        help="bytes of text per token shard (default: 64 MiB)")
    parser.add_argument("--verify", action="store_true",
                        help="check the sha256 of every file of the finished store; damaged "
                             "shards are rebuilt")


_OPTIONS = {"sources": "--source", "cache_dir": "--cache-dir", "vocab_size": "--vocab-size",
            "tokenizer": "--tokenizer", "max_bytes_per_domain": "--max-bytes-per-domain",
            "val_fraction": "--val-fraction", "test_fraction": "--test-fraction"}


def config_from_args(args: argparse.Namespace) -> DataConfig:
    """The data config: an experiment config's data section (CONFIG / --set), else the options."""
    given = [opt for f, opt in _OPTIONS.items() if getattr(args, f, None) not in (None, [])]
    if getattr(args, "config", None) is not None or getattr(args, "overrides", None):
        if given:
            raise ConfigError(f"{given[0]} cannot be combined with an experiment config: use "
                              f"--set data.{next(f for f, o in _OPTIONS.items() if o == given[0])}"
                              "=VALUE, so that training uses the same cache")
        data = load_config(config_path(args.config, args.overrides), args.overrides).data
        data.cache_dir = str(Path(data.cache_dir).resolve())  # as the trainer resolves it
        return data
    d = DataConfig()
    return DataConfig(
        sources=list(args.sources) if args.sources else ["builtin"],
        cache_dir=args.cache_dir if args.cache_dir is not None else DEFAULT_CACHE_DIR,
        vocab_size=args.vocab_size if args.vocab_size is not None else d.vocab_size,
        tokenizer=args.tokenizer,
        max_bytes_per_domain=(args.max_bytes_per_domain if args.max_bytes_per_domain is not None
                              else d.max_bytes_per_domain),
        val_fraction=args.val_fraction if args.val_fraction is not None else d.val_fraction,
        test_fraction=args.test_fraction if args.test_fraction is not None else d.test_fraction,
    )


def _build_options(args: argparse.Namespace) -> dict:
    workers = getattr(args, "workers", None)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers={workers} must be >= 1")
    out = {"workers": workers}
    shard = getattr(args, "shard_bytes", None)
    if shard is not None:
        if shard < 1:
            raise ConfigError(f"--shard-bytes={shard} must be >= 1")
        out["shard_bytes"] = shard
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``remoe data``; returns the process exit code."""
    from remoe.data.pipeline import prepare_data

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args).validate()
        extra = _build_options(args)
        if getattr(args, "verify", False):
            from remoe.data.cachelock import locked
            from remoe.data.streambuild import verify_store

            with locked(Path(cfg.cache_dir)):  # not while a build writes it
                problems = verify_store(Path(cfg.cache_dir))
            for p in problems:
                print(f"damaged: {p}", file=sys.stderr)
            print(f"verify: {'no problem' if not problems else f'{len(problems)} problem(s)'}",
                  file=sys.stderr)
        bundle = prepare_data(cfg, progress=not args.quiet, **extra)
    except ConfigError as e:
        print(f"remoe data: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"remoe data: error: {e}", file=sys.stderr)
        return 1
    print(bundle.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remoe data", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
