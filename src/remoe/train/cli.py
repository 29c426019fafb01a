"""``remoe train``: train a model from a YAML config with dotted ``--set`` overrides."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remoe.allocator import MODES

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_remoe.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="experiment YAML (default: configs/tiny_remoe.yaml, a tiny ReMoE on the "
                        "built-in corpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set model.num_experts=16 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its latest checkpoint (bit-exact on CPU)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit (validates it)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    p.add_argument("--allocator", choices=MODES, default="auto",
                   help="host allocator (remoe.allocator): auto (default: re-run with tcmalloc when "
                        "libtcmalloc_minimal is installed: no page faults on fresh large gradients), "
                        "default (system malloc), tcmalloc, retain (glibc keeps freed large blocks)")


def _config_path(arg: str | None) -> Path | None:
    if arg is not None:
        return Path(arg)
    # from a source checkout; otherwise the dataclass defaults (the same tiny ReMoE)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def run(args: argparse.Namespace) -> int:
    from remoe.train.config import load_config

    cfg = load_config(_config_path(args.config), args.overrides)  # fails fast, before any data
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from remoe.allocator import configure as configure_allocator
    from remoe.train.trainer import Trainer, TrainingDiverged, format_summary

    configure_allocator(args.allocator, "remoe train",
                        may_reexec=getattr(args, "owns_process", False))

    trainer = Trainer(cfg, resume=args.resume, progress=False if args.no_progress else None)
    try:
        summary = trainer.train()
    except TrainingDiverged as e:
        print(f"remoe train: error: {e}", file=sys.stderr)
        return 3
    if trainer.dist.is_main:
        print(format_summary(summary))
        if summary.get("settling_step") is None and summary.get("target_sparsity"):
            print("note: sparsity has not settled at its target yet: train longer "
                  "(--set train.max_steps=...)")
    return 0
