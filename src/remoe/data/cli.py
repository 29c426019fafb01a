"""``remoe data``: build (or verify) the corpus, tokenizer and token cache, print a summary."""

from __future__ import annotations

import argparse
import logging
import sys

from remoe.data.config import DEFAULT_CACHE_DIR, DataConfig
from remoe.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``remoe data`` options to ``parser``."""
    d = DataConfig()
    parser.add_argument("--source", action="append", dest="sources", metavar="SPEC",
                        help="data source (repeatable): 'builtin', 'builtin:code,prose', a "
                             ".txt/.jsonl/.jsonl.zst file or directory, or NAME=PATH "
                             "(default: builtin)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                        help=f"cache directory (default: {DEFAULT_CACHE_DIR})")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size,
                        help=f"BPE vocabulary size to train (default: {d.vocab_size})")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="use this tokenizer.json or GPT-2 vocab.json (+merges.txt) instead "
                             "of training one")
    parser.add_argument("--max-bytes-per-domain", type=int, default=d.max_bytes_per_domain,
                        help=f"byte budget per domain (default: {d.max_bytes_per_domain:,})")
    parser.add_argument("--val-fraction", type=float, default=d.val_fraction,
                        help=f"validation share of documents (default: {d.val_fraction})")
    parser.add_argument("--test-fraction", type=float, default=d.test_fraction,
                        help=f"test share of documents (default: {d.test_fraction})")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def config_from_args(args: argparse.Namespace) -> DataConfig:
    return DataConfig(
        sources=list(args.sources) if args.sources else ["builtin"],
        cache_dir=args.cache_dir,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        max_bytes_per_domain=args.max_bytes_per_domain,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``remoe data``; returns the process exit code."""
    from remoe.data.pipeline import prepare_data

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args).validate()
        bundle = prepare_data(cfg, progress=not args.quiet)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(bundle.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remoe data", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
