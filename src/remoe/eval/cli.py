"""``remoe eval``: held-out loss per domain and zero-shot accuracy of one or more checkpoints.

    remoe eval runs/remoe runs/dmoe --names ReMoE dMoE --tasks builtin,paper --out results.json

For each CHECKPOINT (a run directory, a checkpoint directory or an HF directory) it prints the
validation (or ``--split test``) loss and perplexity overall and per domain, then the zero-shot
table in the paper's layout (one row per model, one column per task, Avg.) in Markdown, and
writes everything as JSON plus one CSV row per model: to ``--out FILE.json``, else, for every
CHECKPOINT given as a run directory, its own results to ``RUN/eval_results.json`` (where
``remoe report RUN`` reads them). The loss is over the whole held-out split (``--loss-chunks``
caps it), unlike the training log's validation loss (``train.eval_chunks_per_domain``
sequences per domain). The data for the loss is the run's (``config.yaml``'s ``data``
section, in the run directory or above the checkpoint) or ``--data-cache DIR``. An unknown
task name stops the command before any work. Nothing is downloaded; see ``docs/EVAL.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from remoe import rundir
from remoe.errors import ConfigError
from remoe.eval.offline import force_offline
from remoe.eval.output import report_results
from remoe.model.bundle import file_sha256

log = logging.getLogger("remoe.eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                        help="run directory, checkpoint directory or HF directory")
    parser.add_argument("--names", nargs="+", metavar="NAME",
                        help="row names, one per checkpoint (default: the run/dir names)")
    parser.add_argument("--tasks", default="builtin",
                        help="zero-shot tasks, comma-separated: 'builtin' (remoe_lambada, "
                             "remoe_hellaswag, remoe_domain), 'paper' (ARC-c/e, BoolQ, HellaSwag, "
                             "LAMBADA, PIQA, RACE), 'none', or task names (default: builtin)")
    parser.add_argument("--split", choices=("validation", "test"), default="validation",
                        help="held-out split of the loss (default: validation)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="at most N examples per zero-shot task")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the results as JSON here (and FILE.csv beside it); default: "
                             "RUN/eval_results.json for every CHECKPOINT that is a run "
                             "directory (read by `remoe report RUN`)")
    parser.add_argument("--no-save", action="store_true",
                        help="print only: write no results file")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences per forward pass (default: 8)")
    parser.add_argument("--data-cache", default=None, metavar="DIR",
                        help="prepared data cache (`remoe data --cache-dir`) to take the loss "
                             "batches and held-out documents from, instead of the run's")
    parser.add_argument("--task-data-dir", default=None, metavar="DIR",
                        help="local data of standard tasks: DIR/<task>/ (save_to_disk or "
                             "<split>.jsonl/.parquet) or DIR/<hf dataset path>/")
    parser.add_argument("--task-cache", default=None, metavar="DIR",
                        help="where the built-in tasks are written (default: "
                             "<data cache>/eval_tasks/test)")
    parser.add_argument("--num-examples", type=int, default=300, metavar="N",
                        help="examples per built-in task (default: 300)")
    parser.add_argument("--task-seed", type=int, default=1234,
                        help="seed of the built-in tasks (default: 1234)")
    parser.add_argument("--loss-chunks", type=int, default=None, metavar="N",
                        help="at most N sequences per domain for the loss (default: all)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length of the loss (default: the run's train.seq_len, "
                             "else the model's maximum)")
    parser.add_argument("--no-loss", action="store_true", help="skip the held-out loss")
    parser.add_argument("--gate-threshold", type=float, nargs="+", default=None, metavar="TAU",
                        help="ReLU-routed models: sweep the inference-time gate threshold tau "
                             "(gates <= tau inactive; 0 = the trained model) and report loss vs "
                             "active experts per token, e.g. --gate-threshold 0 0.01 0.03 0.1")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:i] (default: auto)")


# ----------------------------------------------------------------------------- helpers

def _run_config(path: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The run's ``config.yaml`` (parsed) found at, or up to two levels above, ``path``."""
    import yaml

    for d in (path, path.parent, path.parent.parent):
        f = d / "config.yaml"
        if f.is_file():
            try:
                return yaml.safe_load(f.read_text()) or {}, d
            except yaml.YAMLError as e:
                raise ConfigError(f"{f} is not valid YAML: {str(e).splitlines()[0]}") from None
    return None, None


def _default_name(path: Path, model_dir: Path, run_dir: Path | None) -> str:
    if run_dir is not None:
        if model_dir.name.startswith("step_"):
            return f"{run_dir.name}@{int(model_dir.name[5:])}"
        return run_dir.name
    return path.resolve().name


class _DataCache:
    """Prepared data bundles by cache directory (each opened once)."""

    def __init__(self) -> None:
        self.bundles: dict[str, Any] = {}

    def get(self, cache_dir: str | Path | None, run_cfg: dict[str, Any] | None,
            run_dir: Path | None) -> Any:
        """The bundle of ``--data-cache`` if given, else of the run config's ``data`` section.

        A relative ``data.cache_dir`` is tried from the current directory, then from the
        directory the run was trained in (``run_dir`` minus ``run.out_dir/run.name``). A run
        whose cache does not exist any more has it prepared again from its data config.
        """
        from remoe.data import DataConfig, prepare_data
        from remoe.data.pipeline import has_prepared

        if cache_dir is not None:
            return self._open(Path(cache_dir))
        section = (run_cfg or {}).get("data")
        if not isinstance(section, dict):
            return None
        cfg = DataConfig.from_dict(section)
        candidates = [Path(cfg.cache_dir)]
        out_dir = ((run_cfg or {}).get("run") or {}).get("out_dir")
        if not candidates[0].is_absolute() and run_dir is not None and out_dir \
                and not Path(out_dir).is_absolute():
            depth = len(Path(out_dir).parts) + 1  # run_dir = <train cwd>/<out_dir>/<name>
            if len(run_dir.resolve().parents) >= depth:
                candidates.append(run_dir.resolve().parents[depth - 1] / cfg.cache_dir)
        for c in candidates:
            if has_prepared(c):
                return self._open(c)
        where = candidates[-1]
        key = str(where.resolve())
        if key not in self.bundles:
            print(f"remoe eval: no prepared data cache at {where}; preparing it from the run's "
                  "data config (as `remoe data` would)", file=sys.stderr)
            cfg.cache_dir = str(where)
            self.bundles[key] = prepare_data(cfg, progress=False)
        return self.bundles[key]

    def _open(self, cache_dir: Path) -> Any:
        from remoe.data import load_prepared

        key = str(cache_dir.resolve())
        if key not in self.bundles:
            try:
                self.bundles[key] = load_prepared(cache_dir, verify=False)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"data cache {str(cache_dir)!r}: {e}") from None
        return self.bundles[key]


def check_task_names(spec: str) -> None:
    """Every name of a ``--tasks`` selection must be a known task (a one-line ConfigError
    otherwise, before any model or data is loaded); a known task whose data is not local is
    not an error here (it is skipped later, with how to provide it)."""
    import difflib

    from remoe.eval.builtin_tasks import BUILTIN_TASKS
    from remoe.eval.standard import PAPER_TASK_NAMES, lm_eval_task_config
    from remoe.eval.zeroshot import parse_task_selection

    _, standard = parse_task_selection(spec)
    known = ["builtin", "paper", "none", *BUILTIN_TASKS, *PAPER_TASK_NAMES]
    for name in standard:
        if name in PAPER_TASK_NAMES:
            continue
        try:
            if not _named_in_lm_eval(name):  # fast: no need to index every lm-eval task
                raise KeyError(name)
            lm_eval_task_config(name)
        except KeyError:
            near = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise ConfigError(f"--tasks={spec!r}: unknown task {name!r}{hint}; use builtin, "
                              f"paper, none, or lm-eval task names") from None


def _named_in_lm_eval(name: str) -> bool:
    """Whether ``name`` occurs in any of lm-eval's task YAML files (a task it defines must; a
    plain byte search over them takes seconds, indexing them all takes a minute)."""
    import lm_eval.tasks

    needle = name.encode()
    root = Path(lm_eval.tasks.__file__).parent
    return any(needle in p.read_bytes() for p in root.rglob("*.yaml"))


def _saves(args: argparse.Namespace, entries: list[dict[str, Any]]) -> list[tuple[Path, list]]:
    """Where the results go: ``(json path, names of the models it holds)``."""
    if args.no_save:
        return []
    if args.out:
        return [(Path(args.out), [e["name"] for e in entries])]
    return [(Path(e["run_dir"]) / "eval_results.json", [e["name"]]) for e in entries
            if e["run_dir"] is not None
            and Path(e["path"]).resolve() == Path(e["run_dir"]).resolve()]


# ----------------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> int:
    # every checkpoint is pinned (a private snapshot) until the end: a run still training may
    # prune or replace it meanwhile (remoe.rundir.loading.pinned_model_dir)
    with ExitStack() as pins:
        return _run(args, pins)


def _run(args: argparse.Namespace, pins: ExitStack) -> int:
    force_offline()
    check_task_names(args.tasks)  # a misspelt task stops here, before any model or data
    import torch

    from remoe.machine.threads import fix_threads

    fix_threads("remoe eval")  # the training policy: all usable cores, fixed; a load hint

    from remoe.rundir.loading import load_model, pinned_model_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.names and len(args.names) != len(args.checkpoints):
        raise ConfigError(f"--names has {len(args.names)} names for {len(args.checkpoints)} "
                          "checkpoints")
    for opt in ("limit", "batch_size", "num_examples", "loss_chunks", "seq_len"):
        v = getattr(args, opt)
        if v is not None and v < 1:
            raise ConfigError(f"--{opt.replace('_', '-')}={v} must be >= 1")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    # what each checkpoint is and which data goes with it
    entries = []
    for i, ck in enumerate(args.checkpoints):
        path = Path(ck)
        model_dir, load_dir = pins.enter_context(pinned_model_dir(path))
        run_cfg, run_dir = _run_config(model_dir)
        name = args.names[i] if args.names else _default_name(path, model_dir, run_dir)
        entries.append({"name": name, "path": str(path), "model_dir": str(model_dir),
                        "load_dir": str(load_dir), "run_cfg": run_cfg, "run_dir": run_dir})
    seen: dict[str, int] = {}
    for e in entries:  # unique row names
        seen[e["name"]] = seen.get(e["name"], 0) + 1
        if seen[e["name"]] > 1:
            e["name"] = f"{e['name']} ({seen[e['name']]})"

    data = _DataCache()

    def bundle_for(e: dict[str, Any]) -> Any:
        return data.get(args.data_cache, e["run_cfg"], e["run_dir"])

    # the zero-shot plan (built-in tasks come from the first checkpoint's held-out data)
    plan = None
    manifest: dict[str, Any] = {}
    from remoe.eval.zeroshot import parse_task_selection, plan_tasks

    builtin_names, standard_names = parse_task_selection(args.tasks)
    if builtin_names or standard_names:
        from remoe.eval.builtin_tasks import BuiltinTaskConfig, builtin_tasks_from_bundle

        task_cfg = BuiltinTaskConfig(num_examples=args.num_examples, seed=args.task_seed)

        def build(names: list[str]):
            bundle = next((b for b in map(bundle_for, entries) if b is not None), None)
            if bundle is None:
                why = ("no data for the built-in tasks: no config.yaml found with the "
                       "checkpoint; pass --data-cache DIR")
                return None, {t: why for t in names}
            out, m = builtin_tasks_from_bundle(bundle, args.task_cache, task_cfg, names)
            manifest.update(m)
            return out, dict(m.get("skipped", {}))

        plan = plan_tasks(args.tasks, build, args.task_data_dir)
        for task, why in plan.skipped.items():
            print(f"remoe eval: {why}" if why.startswith("task ") else
                  f"remoe eval: task {task} skipped: {why}", file=sys.stderr)
        if not plan.runnable:  # nothing the user asked for can run: no work, no file touched
            print(f"remoe eval: error: every requested task was skipped "
                  f"({', '.join(sorted(plan.skipped))}); nothing evaluated, no results file "
                  "changed", file=sys.stderr)
            return 1

    models: list[dict[str, Any]] = []
    for e in entries:
        print(f"remoe eval: {e['name']} ({e['model_dir']})", file=sys.stderr)
        model, tok_path = load_model(e["load_dir"], device=device)
        rec: dict[str, Any] = {"name": e["name"], "path": e["path"], "model_dir": e["model_dir"],
                               "parameters": model.num_parameters(),
                               "active_parameters": model.num_parameters(active=True),
                               "loss": None, "loss_skipped": None, "zero_shot": {},
                               "averages": {}}
        if not args.no_loss:
            rec["loss"], rec["loss_skipped"] = _loss(e, model, tok_path, bundle_for(e), args, device)
            if rec["loss_skipped"]:
                print(f"remoe eval: {e['name']}: loss skipped: {rec['loss_skipped']}",
                      file=sys.stderr)
        if args.gate_threshold:
            rec["gate_threshold_sweep"] = _dial(e, model, bundle_for(e), args, device)
        if plan is not None and plan.runnable:
            if tok_path is None:
                raise ConfigError(f"checkpoint={e['path']!r} has no tokenizer.json")
            from remoe.eval.adapter import RemoeLM
            from remoe.eval.zeroshot import run_tasks

            lm = RemoeLM(pretrained=model, tokenizer=tok_path, batch_size=args.batch_size)
            zs = run_tasks(lm, plan, limit=args.limit)
            rec["zero_shot"] = zs["results"]
            rec["n_samples"] = zs["n_samples"]
            rec["zero_shot_skipped"] = zs.get("skipped", {})  # continuation longer than context
        models.append(rec)
        del model

    if not any(m.get("loss") or m.get("zero_shot") or m.get("gate_threshold_sweep")
               for m in models):
        print("remoe eval: error: nothing evaluated (see the messages above); no results file "
              "changed", file=sys.stderr)
        return 1
    seq_lens = {m["loss"]["seq_len"] for m in models if m.get("loss")}
    if len(seq_lens) > 1:
        print(f"remoe eval: note: the losses use different sequence lengths {sorted(seq_lens)} "
              "(each run's train.seq_len); pass --seq-len to compare them", file=sys.stderr)
    saves = []
    for out, names in _saves(args, entries):
        if not args.out:  # into a run directory: only under its lock, never while it trains
            try:
                pins.enter_context(_held(rundir.RunLock.acquire(out.parent)))
            except ConfigError as e:
                why = str(e).split(";")[0]  # "run directory R is in use by pid N (...)"
                print(f"remoe eval: results not written: {why}; pass --out FILE to keep them",
                      file=sys.stderr)
                continue
        saves.append((out, names))
    return report_results(args, models, plan, manifest or None, saves)


@contextmanager
def _held(lock):
    try:
        yield lock
    finally:
        lock.release()


def _loss(e: dict[str, Any], model: Any, tok_path: str | None, bundle: Any,
          args: argparse.Namespace, device: str) -> tuple[dict[str, Any] | None, str | None]:
    from tqdm.auto import tqdm

    from remoe.model.losses import evaluate_loss

    if bundle is None:
        return None, "no data: no config.yaml found with the checkpoint; pass --data-cache DIR"
    if tok_path is not None and file_sha256(tok_path) != bundle.manifest["tokenizer"]["sha256"]:
        return None, (f"the checkpoint's tokenizer.json differs from the data cache's "
                      f"({bundle.cache_dir}); its token ids would not match")
    b = model.spec.backbone
    if b.vocab_size < bundle.vocab_size:
        return None, f"model vocab_size {b.vocab_size} < the data's {bundle.vocab_size}"
    seq_len = _seq_len(e, model, args)
    batches = bundle.eval_batches(args.split, seq_len=seq_len, batch_size=args.batch_size,
                                  max_chunks_per_domain=args.loss_chunks)
    # a progress line while the (minutes-long) whole-split pass runs; only on a terminal
    batches = tqdm(batches, desc=f"{e['name']}: {args.split} loss", unit=" batches",
                   disable=None, leave=False)
    res = evaluate_loss(model, batches, list(bundle.domains), device=device)
    res.update(split=args.split, seq_len=seq_len, data_cache=str(bundle.cache_dir),
               chunks_per_domain=args.loss_chunks)  # None: the whole split
    if not res["tokens"]:
        return None, (f"the {args.split} split has no chunk of {seq_len + 1} tokens "
                      f"(try a smaller --seq-len)")
    return res, None


def _dial(e: dict[str, Any], model: Any, bundle: Any, args: argparse.Namespace,
          device: str) -> list[dict[str, Any]]:
    """``--gate-threshold``: loss vs active experts per token for each tau (remoe.eval.dial)."""
    from remoe.eval.dial import format_sweep, threshold_sweep

    if bundle is None:
        raise ConfigError("--gate-threshold needs the run's data: no config.yaml found with the "
                          "checkpoint; pass --data-cache DIR")
    seq_len = _seq_len(e, model, args)
    rows = threshold_sweep(model, lambda: bundle.eval_batches(
        args.split, seq_len=seq_len, batch_size=args.batch_size,
        max_chunks_per_domain=args.loss_chunks), args.gate_threshold, device=device)
    print(format_sweep(e["name"], rows, model.spec.routing.num_routed))
    return rows


def _seq_len(e: dict[str, Any], model: Any, args: argparse.Namespace) -> int:
    """--seq-len, else the run's train.seq_len, else the model's context; at most the latter."""
    max_pos = model.spec.backbone.max_position_embeddings
    seq_len = args.seq_len or ((e["run_cfg"] or {}).get("train") or {}).get("seq_len") or max_pos
    return min(int(seq_len), max_pos)
