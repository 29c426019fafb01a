"""``remoe train``: train a model from a YAML config with dotted ``--set`` overrides."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from remoe import rundir
from remoe.machine.allocator import MODES



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="experiment YAML (default: configs/tiny_remoe.yaml, a tiny ReMoE on the "
                        "built-in corpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set model.num_experts=16 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its latest checkpoint (bit-exact on CPU)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds a run: its old contents are "
                        "moved to <run dir>.old-<time> (nothing is deleted)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit (validates it)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    p.add_argument("--allocator", choices=MODES, default="auto",
                   help="host allocator (remoe.machine.allocator): auto (default: re-run with tcmalloc when "
                        "libtcmalloc_minimal is installed: no page faults on fresh large gradients), "
                        "default (system malloc), tcmalloc, retain (glibc keeps freed large blocks)")


@contextlib.contextmanager
def _data_stage_lines(enabled: bool):
    """Without a progress display (``remoe train > log 2>&1``), data preparation's stage lines
    (logged by ``remoe.data`` at INFO) go to stdout, on rank 0 only."""
    import logging

    if not enabled or os.environ.get("RANK", "0") != "0":
        yield
        return
    logger, handler = logging.getLogger("remoe.data"), logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _prepare_run_dir(cfg, args: argparse.Namespace) -> None:
    """The run-directory checks that need no data: another writer, a fresh run into an old
    one (or --overwrite: archive it), a resume that changes the model. The trainer repeats the
    authoritative ones under the lock."""
    from remoe.errors import ConfigError

    if args.overwrite and args.resume:
        raise ConfigError("--overwrite and --resume exclude each other (--overwrite starts the "
                          "run over, --resume continues it)")
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 owns the run directory
        return
    run_dir = cfg.run_dir
    rundir.check_not_locked(run_dir)
    if args.overwrite:
        if not rundir.contents(run_dir):
            return
        lock = rundir.RunLock.acquire(run_dir)
        try:
            moved = rundir.archive_contents(run_dir)
        finally:
            lock.release()
        if moved is not None:
            print(f"remoe train: --overwrite: moved the old contents of {run_dir} to {moved}",
                  file=sys.stderr)
    elif args.resume:
        from remoe.rundir.lock import has_checkpoint
        from remoe.train.checkpoint import check_resume_model

        if not has_checkpoint(run_dir):  # say it now, not after the data is prepared
            started = bool(rundir.contents(run_dir))
            raise ConfigError(f"--resume: no checkpoint under {run_dir / 'checkpoints'} (the run "
                              + ("stopped before its first checkpoint); start it over with "
                                 "--overwrite" if started else
                                 "has not been started); start it without --resume"))
        check_resume_model(run_dir, cfg.to_dict())
    else:
        rundir.require_fresh(run_dir)
    _check_writable(run_dir)


def _check_writable(run_dir) -> None:
    """The run directory can be created and written (a probe directory made and removed in
    the nearest existing ancestor): /proc, a read-only mount, no permission -> one line now."""
    import tempfile
    from pathlib import Path

    from remoe.errors import ConfigError

    anc = Path(run_dir)
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".remoe-write-probe-", dir=anc))
    except OSError as e:
        raise ConfigError(f"run.out_dir: {run_dir} cannot be written ({e.strerror or e} in "
                          f"{anc}); choose another run.out_dir") from None


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: the user's own, without --overwrite, plus
    --resume."""
    import shlex

    cmd = ["remoe", "train"] + ([args.config] if args.config is not None else [])
    for o in args.overrides:
        cmd += ["--set", o]
    if args.no_progress:
        cmd.append("--no-progress")
    if args.allocator != "auto":
        cmd += ["--allocator", args.allocator]
    return shlex.join(cmd + ["--resume"])


def run(args: argparse.Namespace) -> int:
    from remoe.configfile import config_path
    from remoe.experiment import load_config

    # fails fast, before any data (with train.init_from the default file's model: section,
    # the default model, is not an override of the source's)
    cfg = load_config(config_path(args.config, args.overrides), args.overrides,
                      default_file=args.config is None)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from remoe.train.memcheck import check_fits

    check_fits(cfg)  # a model or batch that cannot fit: one line now, not an allocator error later
    _prepare_run_dir(cfg, args)  # before any data or model work
    from remoe.machine.allocator import configure as configure_allocator
    from remoe.train.metrics import format_summary
    from remoe.train.interrupt import TrainingInterrupted
    from remoe.train.optim import TrainingDiverged
    from remoe.train.trainer import Trainer

    configure_allocator(args.allocator, "remoe train",
                        may_reexec=getattr(args, "owns_process", False))

    try:
        with _data_stage_lines(args.no_progress or not sys.stderr.isatty()):
            trainer = Trainer(cfg, resume=args.resume, progress=False if args.no_progress else None)
        try:
            summary = trainer.train()
        finally:
            trainer.close()
    except TrainingInterrupted as e:
        print(f"remoe train: interrupted after step {e.step}; checkpoint {e.checkpoint}\n"
              f"resume with: {resume_command(args)}", file=sys.stderr)
        return e.exit_status
    except TrainingDiverged as e:
        print(f"remoe train: error: {e}", file=sys.stderr)
        return 3
    except OSError as e:  # a write the run-directory code does not wrap (e.g. routing masks)
        if not rundir.is_disk_full(e):
            raise
        print(f"remoe train: error: disk full while writing {e.filename or cfg.run_dir}",
              file=sys.stderr)
        return 2
    if trainer.dist.is_main:
        print(format_summary(summary))
        # name what two numbers mean (they differ from `remoe eval` and from metrics.jsonl)
        print(f"notes        validation = {cfg.train.eval_chunks_per_domain} sequences per domain "
              "(`remoe eval RUN`: the whole split)"
              + ("; lambda = after the last update (the next step's; metrics.jsonl has the "
                 "one each step used)" if summary.get("final_lambda") is not None else ""))
        # only an adaptive router (it has a lambda controller) steers toward a target
        if summary.get("settling_step") is None and summary.get("target_sparsity") \
                and summary.get("final_lambda") is not None:
            print("note: sparsity has not settled at its target yet: train longer "
                  "(--set train.max_steps=...)")
    return 0
