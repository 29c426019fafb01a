"""``remoe train``: train a model from a YAML config with dotted ``--set`` overrides."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from remoe import rundir
from remoe.errors import ConfigError
from remoe.machine.allocator import MODES
from remoe.model import registry

GIB = 1024 ** 3


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

    anc = Path(run_dir)
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".remoe-write-probe-", dir=anc))
    except OSError as e:
        raise ConfigError(f"run.out_dir: {run_dir} cannot be written ({e.strerror or e} in "
                          f"{anc}); choose another run.out_dir") from None


# ----------------------------------------------------------------------------- memory
# A lower bound of a run's memory, checked before any data or model work.
#
# ``model.hidden_size=1000000`` or ``train.micro_batch_size=1e9`` used to fail with an allocator
# error minutes later (after the data was prepared, or at step 1 with files left behind). The
# bound here is deliberately low, so it refuses only what cannot fit: the model state (fp32
# weight, gradient and AdamW's two moments, 16 bytes a parameter, sharded over the ranks with
# ``train.fsdp``) plus the LM head's logits and their gradient for one micro-batch (8 bytes a
# logit). Parameters in closed form from the model section (no tensor is made): embedding and
# LM head ``V D`` each, attention ``2 D^2 + 2 D n_kv d_h``, FFN ``3 D F`` dense or ``E 3 D F``
# for ``E G`` experts of width ``F / G`` plus the ``[E G, D]`` router, norms ``D``.

def param_lower_bound(spec) -> int:
    b, r = spec.backbone, spec.routing
    D, L, V = b.hidden_size, b.num_layers, b.vocab_size
    F = b.ffn_hidden_size or 4 * D
    dh = D // max(1, b.num_heads)
    attn = 2 * D * D + 2 * D * b.num_kv_heads * dh
    # a dense FFN kind: one FFN of width F (a lower bound for dense x E too)
    dense = not registry.declares(r.router, "is_moe")
    ffn = 3 * D * F if dense else r.num_experts * 3 * D * F + r.num_routed * D
    return 2 * V * D + L * (attn + ffn + 2 * D) + D


def machine_bytes() -> tuple[int, str]:
    """``(bytes, what)``: the memory this process can use (RAM, capped by a cgroup limit)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "RAM"
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, what = int(text), "memory limit (cgroup)"
        break
    return total, what


def check_fits(cfg) -> None:
    """Refuse (one line) a run whose lower bound exceeds this machine's memory (CPU runs) or
    the GPU's (CUDA runs)."""
    if cfg.train.init_from is not None:
        return  # the model comes from the source (checked when it is read)
    spec = cfg.model_spec(vocab_size=cfg.data.vocab_size)
    params = param_lower_bound(spec)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    state = 16 * params / (world if cfg.train.fsdp else 1)
    logits = 8 * cfg.train.micro_batch_size * cfg.train.seq_len * spec.backbone.vocab_size
    need = state + logits
    device = str(getattr(cfg.train, "device", "auto") or "auto")
    have, what = machine_bytes()
    if device.startswith("cuda") or device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                have = torch.cuda.get_device_properties(0).total_memory
                what = "GPU memory"
        except Exception:  # noqa: BLE001 - no usable CUDA: the CPU bound stands
            pass
    if need > have:
        raise ConfigError(
            f"this run needs at least {need / GIB:,.1f} GiB (model state {state / GIB:,.1f} GiB "
            f"for {params:,} parameters; logits of one micro-batch {logits / GIB:,.1f} GiB) but "
            f"the machine's {what} is {have / GIB:,.1f} GiB: lower model.hidden_size / "
            "model.num_experts / model.num_layers or train.micro_batch_size / train.seq_len")


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
    check_fits(cfg)  # a model or batch that cannot fit: one line now, not an allocator error later
    _prepare_run_dir(cfg, args)  # before any data or model work
    from remoe.machine.allocator import configure as configure_allocator
    from remoe.train.metrics import format_summary
    from remoe.train.optim import TrainingDiverged
    from remoe.train.runtime import TrainingInterrupted
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
