"""The ``remoe`` command: ``remoe data|train|eval|analyze|report|bench``.

Each subcommand lives in its package as a module with ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them. A :class:`ConfigError` anywhere is printed as
one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from remoe.errors import ConfigError

COMMANDS = {
    "data": ("remoe.datacli", "build the corpus, tokenizer and token cache"),
    "train": ("remoe.train.cli", "train a model from a YAML config (with --set overrides)"),
    "eval": ("remoe.eval.cli", "validation loss per domain and zero-shot tasks via lm-eval"),
    "analyze": ("remoe.lab.analysis.cli", "the paper's analyses of a run: stages, sparsity, flips, routing"),
    "report": ("remoe.lab.analysis.report_cli", "an HTML report of one or several runs"),
    "bench": ("remoe.lab.bench.cli", "layer / model / machine benchmarks (table + JSON)"),
    "study": ("remoe.lab.study.cli", "a resumable grid of training runs from one YAML, with tables"),
    "convert": ("remoe.convert.cli", "upcycle a dense model, import a Mixtral, export to Mixtral"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; only the chosen command's module is imported (fast ``--help``)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = argparse.ArgumentParser(prog="remoe", description="ReLU-routed Mixture-of-Experts "
                                     "language models: train, evaluate, analyse.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def _pin_kernels(args: argparse.Namespace) -> None:
    """``train.portable_kernels``: the CPU kernel paths pinned before the command starts torch
    (remoe.machine.kernels)."""
    from remoe.configfile import config_path
    from remoe.experiment import load_config
    from remoe.machine.kernels import configure

    cfg = load_config(config_path(args.config, args.overrides), args.overrides,
                      default_file=args.config is None)
    configure(cfg.train.portable_kernels, cfg.train.num_threads, args.owns_process)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    # called as the `remoe` command (not main([...]) from a test or notebook): the command may
    # restart its own process, e.g. to preload an allocator (remoe.machine.allocator)
    args.owns_process = argv is None
    try:
        if args.command == "train" and not args.print_config:
            _pin_kernels(args)
        return int(importlib.import_module(args._module).run(args) or 0)
    except ConfigError as e:
        print(f"remoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"remoe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
