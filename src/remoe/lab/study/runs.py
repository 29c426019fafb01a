"""One run of a study: what a spec expands into (:class:`RunSpec`), its full training config
with its stop rule, what ``study.json`` records of it (:class:`RunState`), its ``remoe train``
and ``remoe eval`` children, what its run directory says, and ``remoe study --reuse``."""

from __future__ import annotations

import copy
import ctypes
import math
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from remoe import fileio
from remoe.errors import ConfigError
from remoe.experiment import load_config


def fmt_value(v: Any) -> str:
    """An override's value as a label or a command line shows it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


@dataclass
class RunSpec:
    """One expanded run: ``config`` is the full experiment (sections dict) without its stop
    rule applied; :func:`apply_stop` adds it."""

    name: str
    label: str
    group: str
    seed: int
    overrides: dict[str, Any]  # the spec's overrides of this run (group set + grid + run set)
    config: dict[str, dict[str, Any]]
    stop: dict[str, float] | None = None
    match_of: tuple[str, ...] = ()  # the runs whose FLOPs (summed) this one matches
    init_of: str | None = None  # the run whose weights this one starts from

    @property
    def deps(self) -> tuple[str, ...]:
        """The runs that must have trained before this one starts."""
        return self.match_of + ((self.init_of,) if self.init_of else ())

    def describe_overrides(self, skip: tuple[str, ...] = ()) -> str:
        return " ".join(f"{k}={fmt_value(v)}" for k, v in self.overrides.items() if k not in skip)

    def describe_stop(self) -> str:
        if self.match_of:
            return f"flops of {' + '.join(self.match_of)}"
        if self.stop:
            (k, v), = self.stop.items()
            return f"{k} {v:.3g}" if k == "flops" else f"{k} {int(v)}"
        return f"steps {self.config['train'].get('max_steps', 'default')}"


def apply_stop(run: RunSpec, out_dir: Path, threads: int | None,
               match_flops: float | None = None) -> dict[str, dict[str, Any]]:
    """The run's full config: name, directory, seed, threads and its stop rule.

    ``steps``: ``train.max_steps``. ``tokens``: ``train.max_tokens`` and a schedule horizon
    ``max_steps = ceil(tokens / tokens per step)``. ``flops`` / ``match_flops_of``:
    ``train.max_flops`` and ``max_steps = ceil(flops / nominal FLOPs per step)`` (the run's
    k-sparse cost, :func:`remoe.lab.study.estimate.nominal_step_flops`), so that the cosine
    schedule ends where a sparse-cost run stops; a ReLU run, denser before it settles, reaches
    ``max_flops`` a little earlier. ``match_flops`` is the matched runs' FLOPs, summed (None
    before they finished: a placeholder of 1 FLOP keeps the config valid for checking).
    ``init_from_run``: ``train.init_from`` is that run's directory under ``out_dir``.
    """
    from remoe.lab.study.estimate import nominal_step_flops, tokens_per_step

    cfg = copy.deepcopy(run.config)
    cfg.setdefault("run", {}).update(name=run.name, out_dir=str(out_dir), seed=run.seed)
    if threads is not None:
        cfg.setdefault("train", {})["num_threads"] = threads
    stop = run.stop
    if run.match_of:
        stop = {"flops": float(match_flops) if match_flops else 1.0}
    if run.init_of is not None:  # init_from_run: the study run's directory (its final/)
        cfg.setdefault("train", {})["init_from"] = str(Path(out_dir) / run.init_of)
    if stop:
        (k, v), = stop.items()
        train = cfg.setdefault("train", {})
        if k == "steps":
            train["max_steps"] = int(v)
        elif k == "tokens":
            train["max_tokens"] = int(v)
            train["max_steps"] = max(1, math.ceil(v / tokens_per_step(cfg)))
        else:
            train["max_flops"] = float(v)
            train["max_steps"] = max(1, math.ceil(v / nominal_step_flops(cfg)))
    return cfg


def validate_runs(runs: Iterable[RunSpec]) -> None:
    """Every expanded run's config through the experiment loader, before anything runs."""
    for r in runs:
        try:
            load_config(apply_stop(r, Path("study-check"), None, None))
        except ConfigError as e:
            raise ConfigError(f"study run {r.name} (group {r.group}): {e}") from None


@dataclass
class RunState:
    state: str = "pending"  # pending | running | done | failed | skipped | interrupted
    exit_status: int | None = None
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    wall_s: float | None = None  # of the last attempt (the whole child process)
    total_wall_s: float = 0.0  # over every attempt
    resumed: bool = False
    message: str | None = None
    phase: str = "train"  # train | eval (the zero-shot evaluation of a trained run)
    eval_wall_s: float = 0.0  # of the zero-shot evaluations, over every attempt

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def add_wall(st: RunState, seconds: float) -> None:
    """Training time goes to ``wall_s``/``total_wall_s``, evaluation to ``eval_wall_s``."""
    if st.phase == "eval":
        st.eval_wall_s = (st.eval_wall_s or 0.0) + seconds
    else:
        st.wall_s = seconds
        st.total_wall_s = (st.total_wall_s or 0.0) + seconds


def last_write(paths: list[Path]) -> float | None:
    """The latest modification time among ``paths`` that exist (None: none does)."""
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=None)


#: Config fields that may differ between two runs of the same experiment: threads (they follow
#: --jobs) and where the run lives (a run taken over with ``remoe study --reuse`` keeps the name
#: and directory it was trained under).
NOT_THE_EXPERIMENT = (("train", "num_threads"), ("run", "name"), ("run", "out_dir"))


def default_command(config_path: Path, flags: list[str]) -> list[str]:
    """``python -m remoe.cli train CONFIG --no-progress [--resume | --overwrite]``."""
    return [sys.executable, "-m", "remoe.cli", "train", str(config_path), "--no-progress", *flags]


def eval_command(run_dir: Path, tasks: str, limit: int | None, loss: bool = False) -> list[str]:
    """``python -m remoe.cli eval RUN --tasks TASKS [--no-loss] [--limit N]`` (results in
    ``RUN/eval_results.json``). Without ``loss`` the validation loss is the trainer's final
    evaluation (its fixed sample); with it, ``remoe eval`` adds the loss over the whole split."""
    return [sys.executable, "-m", "remoe.cli", "eval", str(run_dir), "--tasks", tasks,
            *([] if loss else ["--no-loss"]), *(["--limit", str(limit)] if limit else [])]


def eval_done(run_dir: Path, tasks: str, limit: int | None, loss: bool = False) -> bool:
    """``RUN/eval_results.json`` has zero-shot results of ``tasks`` at ``limit`` (and, with
    ``loss``, the whole-split validation loss)."""
    doc = read_json(run_dir / "eval_results.json")
    if not doc or (doc.get("tasks") or {}).get("selection") != tasks or doc.get("limit") != limit:
        return False
    models = doc.get("models") or []
    if loss and not any(m.get("loss") for m in models):
        return False
    return any(m.get("zero_shot") for m in models)


def same_experiment(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config as the experiment loader resolves it, minus the fields that do not change the
    experiment (threads, where the run lives; the data cache is compared by its real path: a
    symlinked checkout reads the same files). Two runs equal under it trained the same model on
    the same data with the same seed, whichever study made them."""
    exp = load_config(cfg)
    d = exp.to_dict()
    for section, key in NOT_THE_EXPERIMENT:
        d.get(section, {}).pop(key, None)
    if d.get("data", {}).get("cache_dir"):
        d["data"]["cache_dir"] = os.path.realpath(d["data"]["cache_dir"])
    # the model as built (preset and defaults applied): `granularity: 1` written out or left
    # to its default is the same model
    d["model"] = exp.model_config(vocab_size=exp.data.vocab_size).to_dict()
    d["model"].pop("transformers_version", None)
    return d


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section) or {}, b.get(section) or {}
        # a key on one side only is a router's option that comes and goes with model.router
        # (or a field of another version): the keys both configs hold decide
        for key in sorted(set(sa) & set(sb)):
            if sa[key] != sb[key]:
                out.append(f"{section}.{key}: {sa.get(key)!r} -> {sb.get(key)!r}")
    return out


def read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return d if isinstance(d, dict) else None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if missing, unreadable or not an object."""
    d = fileio.read_json(path)
    return d if isinstance(d, dict) else None


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the study process dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def tail(path: Path, n: int = 12) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def finished_runs(study_dirs, exclude: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(run directory, :func:`same_experiment` of its config) of every finished run (one with a
    ``summary.json``) under ``<dir>/runs/`` of each study directory, except those in
    ``exclude`` (the study's own runs)."""
    out = []
    for study_dir in study_dirs:
        for summary in sorted(Path(study_dir).glob("runs/*/summary.json")):
            src = summary.parent.resolve()
            if src.parent == Path(exclude).resolve():
                continue
            cfg = read_yaml(src / "config.yaml")
            if not cfg:
                continue
            try:
                out.append((src, same_experiment(cfg)))
            except ConfigError:
                continue  # a run of an older remoe this one cannot read: not the same
    return out


def take_over(src: Path, dst: Path) -> None:
    """Copy a finished run directory to ``dst`` (absent or empty), hard-linking each file
    where the file system allows (no extra disk for checkpoints)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.rmdir()
    shutil.copytree(src, dst, copy_function=_link_or_copy)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
        return dst
    except OSError:
        return shutil.copy2(src, dst)


def adopt_identical(study, selected) -> None:
    """``remoe study --reuse DIR``: a run of ``study`` not started here whose experiment
    (config minus run name and directory; seed included) finished in another study is taken
    over, hard-linked where the file system allows, instead of being trained again. In
    dependency order (``selected``), so a FLOP-matched run can match its adopted reference."""
    found = study.finished_elsewhere()
    for r in selected:
        d = study.run_dir(r)
        if study.trained(r) or study.has_checkpoint(r) or (d.exists() and any(d.iterdir())):
            continue
        if (r.match_of and study.match_flops(r) is None) or r.init_of:
            continue  # no stop point yet, or weights of this study's own run
        want = same_experiment(study.full_config(r))
        src = next((p for p, cfg in found if cfg == want), None)
        if src is None:
            continue
        take_over(src, d)
        study.log(f"  reuse {r.name}  <- {src} (the same experiment, finished)")
        st = study.states[r.name]
        st.state, st.message = ("done" if study.done(r) else "pending"), f"reused from {src}"
