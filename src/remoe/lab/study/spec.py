"""Study specs: one YAML expanded into a list of named training runs (see docs/STUDY.md).

A spec holds a ``budget`` (text), a base experiment (``base_config: file.yaml`` and/or ``base:``
sections, as in ``remoe train`` configs) and ``groups``. Each group expands to runs:

* ``set``: dotted overrides common to the group (``model.num_experts: 32``);
* ``grid``: dotted key -> list of values, expanded as a cartesian product (first key slowest);
* ``runs``: explicit labelled override sets (``- {label: pi, set: {model.lambda_update: pi}}``),
  each crossed with the grid when both are given;
* ``seeds``: the seeds every labelled run is repeated with (default ``[0]``);
* a stop rule: ``stop: {steps|tokens|flops: X}``, or ``match_flops_of: LABEL`` (or a list of
  labels): stop at the training FLOPs the run LABEL (same seed) spent -- the sum over the list --
  read from its ``summary.json`` once finished;
* ``init_from_run: LABEL`` (group or run): start from the weights of the study's run LABEL
  (same seed) once it has trained, as ``train.init_from=<its run directory>`` (the
  recipes: upcycling, router swap).

Overrides apply in the order base < group ``set`` < grid point < explicit run ``set``. A run's
label is the explicit run's label and/or the grid values in short form (``relu-E32``, see
:func:`auto_label`), or the group's ``label:`` template (``str.format`` with ``{label}``,
``{seed}`` and the resolved config as ``{model.num_experts}`` ...); its name is
``<label>-s<seed>``. Every expanded config is validated with
:func:`remoe.experiment.load_config` before anything runs; errors are one-line
:class:`ConfigError` naming the spec field.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from remoe.errors import ConfigError, check
from remoe.experiment import SECTIONS
from remoe.lab.study.runs import RunSpec, fmt_value, validate_runs

SPEC_KEYS = ("name", "budget", "base_config", "base", "groups", "seeds", "out", "report", "eval",
             "results")
EVAL_KEYS = ("tasks", "limit", "loss")
GROUP_KEYS = ("name", "set", "grid", "runs", "seeds", "stop", "match_flops_of", "label",
              "init_from_run")
RUN_KEYS = ("label", "set", "init_from_run")
STOP_KEYS = ("steps", "tokens", "flops")
#: run.* fields the study owns (name, directory and seed of every run)
OWNED = ("run.name", "run.out_dir", "run.seed")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
#: short forms of grid keys in automatic labels: prefix + value ("" = the value alone)
SHORT = {"model.router": "", "model.reg_type": "", "model.sparsity_control": "",
         "model.lambda_update": "", "model.num_experts": "E", "model.top_k": "k",
         "model.granularity": "G", "model.lambda0": "lambda0_", "model.alpha": "alpha",
         "model.max_active": "cap", "train.lr": "lr", "train.max_steps": "steps"}


@dataclass
class StudySpec:
    path: Path
    name: str
    budget: str
    out: str | None
    report: bool
    runs: list[RunSpec] = field(default_factory=list)
    #: zero-shot tasks `remoe eval --tasks` runs on every finished run (None: none)
    eval_tasks: str | None = None
    eval_limit: int | None = None  # `remoe eval --limit`: examples per task
    eval_loss: bool = False  # also the loss over the whole validation split (`remoe eval`)
    #: where finished runs' small outputs are committed (remoe.lab.study.archive); None: nowhere
    results_dir: Path | None = None
    groups: list[str] = field(default_factory=list)

    def by_name(self) -> dict[str, RunSpec]:
        return {r.name: r for r in self.runs}

    def ordered(self) -> list[RunSpec]:
        """Runs in spec order, except that a run named by ``match_flops_of`` or
        ``init_from_run`` comes before the runs that depend on it (a stable topological
        order)."""
        by = self.by_name()
        out: list[RunSpec] = []
        seen: set[str] = set()

        def visit(r: RunSpec, trail: tuple[str, ...]) -> None:
            if r.name in seen:
                return
            check(r.name not in trail, "study: match_flops_of / init_from_run form a cycle: "
                  + " -> ".join(trail + (r.name,)))
            for dep in r.deps:
                visit(by[dep], trail + (r.name,))
            seen.add(r.name)
            out.append(r)

        for r in self.runs:
            visit(r, ())
        return out


# ----------------------------------------------------------------------------- small helpers

def clean_name(text: str, where: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_.+=-]", "_", text)
    check(bool(NAME.match(text)), f"{where}={text!r} must be a non-empty name "
          "(letters, digits, _ . + = -)")
    return text


def dotted(mapping: Any, where: str) -> dict[str, Any]:
    """Check a mapping of ``section.key`` -> value."""
    if mapping is None:
        return {}
    check(isinstance(mapping, dict), f"{where} must be a mapping of section.key: value")
    for key in mapping:
        parts = str(key).split(".")
        check(len(parts) == 2 and all(parts), f"{where}.{key}: keys must be section.key "
              "(e.g. model.num_experts)")
        check(parts[0] in SECTIONS, f"{where}.{key}: unknown section {parts[0]!r} (allowed: "
              f"{', '.join(SECTIONS)})")
        check(key not in OWNED, f"{where}.{key}: set by the study (run names, directories and "
              "seeds come from the spec)")
    return dict(mapping)


def seed_list(value: Any, where: str) -> list[int]:
    check(isinstance(value, list) and len(value) > 0, f"{where}={value!r} must be a non-empty "
          "list of integers")
    for s in value:
        check(isinstance(s, int) and not isinstance(s, bool) and s >= 0,
              f"{where}={value!r} must hold integers >= 0")
    check(len(set(value)) == len(value), f"{where}={value!r} has a repeated seed")
    return list(value)


def positive(v: Any) -> float | None:
    if isinstance(v, str):  # YAML reads 1e12 (no dot) as a string
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def stop_rule(value: Any, where: str) -> dict[str, float] | None:
    if value is None:
        return None
    check(isinstance(value, dict) and len(value) == 1, f"{where}={value!r} must be one of "
          "{steps: N}, {tokens: N}, {flops: X}")
    (k, v), = value.items()
    check(k in STOP_KEYS, f"{where}.{k}: unknown stop rule (allowed: {', '.join(STOP_KEYS)})")
    x = positive(v)
    check(x is not None, f"{where}.{k}={v!r} must be a positive number")
    if k in ("steps", "tokens"):
        check(float(x).is_integer(), f"{where}.{k}={v!r} must be an integer")
    return {k: x}


def merge(base: dict[str, dict[str, Any]], overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = copy.deepcopy(value)
    return out


def sections(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    check(isinstance(raw, dict), f"{where} must be a mapping of sections ({', '.join(SECTIONS)})")
    out = {}
    for k, v in raw.items():
        check(k in SECTIONS, f"{where}: unknown section {k!r} (allowed: {', '.join(SECTIONS)})")
        check(v is None or isinstance(v, dict), f"{where}.{k} must be a mapping")
        out[k] = dict(v or {})
    return out


def _eval_section(raw: Any) -> tuple[str | None, int | None, bool]:
    """``eval: {tasks: builtin, limit: 300, loss: true}``: zero-shot tasks (and, with ``loss``,
    the whole validation split's loss) run on every finished run."""
    if raw is None:
        return None, None, False
    check(isinstance(raw, dict), f"study.eval={raw!r} must be a mapping with tasks (and limit)")
    for k in raw:
        check(k in EVAL_KEYS, f"unknown key study.eval.{k} (allowed: {', '.join(EVAL_KEYS)})")
    tasks, limit = raw.get("tasks"), raw.get("limit")
    check(isinstance(tasks, str) and tasks.strip() not in ("", "none"),
          f"study.eval.tasks={tasks!r} must name tasks as `remoe eval --tasks` does "
          "(e.g. builtin)")
    check(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0),
          f"study.eval.limit={limit!r} must be a positive integer (examples per task)")
    loss = raw.get("loss", False)
    check(isinstance(loss, bool), f"study.eval.loss={loss!r} must be true or false")
    return tasks.strip(), limit, loss


def auto_label(point: dict[str, Any]) -> str:
    """``{"model.router": "relu", "model.num_experts": 32}`` -> ``relu-E32``."""
    parts = []
    for key, v in point.items():
        last = key.split(".")[-1]
        if isinstance(v, bool):
            parts.append(last if v else f"no_{last}")
            continue
        prefix = SHORT.get(key, "" if isinstance(v, str) else last)
        parts.append(f"{prefix}{fmt_value(v)}")
    return "-".join(parts)


def _namespace(config: dict[str, dict[str, Any]]) -> dict[str, SimpleNamespace]:
    """Sections as attribute namespaces for label templates; ``model`` with every default."""
    from remoe.model.config import PRESETS, ReMoEConfig

    model = {k: p.default for k, p in inspect.signature(ReMoEConfig.__init__).parameters.items()
             if k not in ("self", "kwargs")}
    preset = config.get("model", {}).get("preset", "tiny")
    model.update(PRESETS.get(preset, {}))
    model.update(config.get("model", {}))
    if model.get("top_k") is None:
        model["top_k"] = 1
    ns = {s: SimpleNamespace(**config.get(s, {})) for s in SECTIONS if s != "model"}
    ns["model"] = SimpleNamespace(**model)
    return ns


def _format(template: str, where: str, config: dict, **extra: Any) -> str:
    try:
        return template.format(**_namespace(config), **extra)
    except (AttributeError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{where}={template!r} cannot be formatted: {e!r} (use {{label}}, "
                          "{seed} or section.key fields such as {model.num_experts})") from None


# ----------------------------------------------------------------------------- loading

def load_spec(path: str | Path, validate: bool = True) -> StudySpec:
    """Read, expand and (by default) validate a study spec."""
    p = Path(path)
    check(p.is_file(), f"spec={str(p)!r} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"spec={str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    check(isinstance(raw, dict), f"spec={str(p)!r} must be a mapping")
    check("groups" in raw or not set(raw) & set(SECTIONS),
          f"spec={str(p)!r} is a remoe train config (sections {', '.join(SECTIONS)}), not a "
          "study spec: a spec names it with base_config: (see docs/STUDY.md)")
    for k in raw:
        check(k in SPEC_KEYS, f"unknown key study.{k} (allowed: {', '.join(SPEC_KEYS)})")
    budget = raw.get("budget")
    check(isinstance(budget, str) and budget.strip() != "", "study.budget must state the "
          "budget of the study as text (e.g. '2 seeds x 10 runs, ~40 CPU-minutes')")
    name = clean_name(str(raw.get("name") or p.stem), "study.name")
    out = raw.get("out")
    check(out is None or isinstance(out, str), f"study.out={out!r} must be a path")
    report = raw.get("report", True)
    check(isinstance(report, bool), f"study.report={report!r} must be true or false")

    base: dict[str, dict[str, Any]] = {}
    if raw.get("base_config") is not None:
        bc = raw["base_config"]
        check(isinstance(bc, str), f"study.base_config={bc!r} must be a path")
        bp = (p.parent / bc) if not Path(bc).is_absolute() else Path(bc)
        check(bp.is_file(), f"study.base_config={bc!r} does not exist (relative to the spec)")
        try:
            base = sections(yaml.safe_load(bp.read_text()) or {}, "study.base_config")
        except yaml.YAMLError as e:
            raise ConfigError(f"study.base_config={bc!r} is not valid YAML: "
                              f"{str(e).splitlines()[0]}") from None
    for section, values in sections(raw.get("base") or {}, "study.base").items():
        base.setdefault(section, {}).update(values)
    for k in ("name", "out_dir", "seed"):
        base.get("run", {}).pop(k, None)  # the study names, places and seeds every run
    # data.cache_dir relative to the working directory, as `remoe train` reads it
    from remoe.data.config import DEFAULT_CACHE_DIR

    data = base.setdefault("data", {})
    data["cache_dir"] = str(Path(data.get("cache_dir") or DEFAULT_CACHE_DIR).resolve())

    default_seeds = seed_list(raw["seeds"], "study.seeds") if "seeds" in raw else [0]
    groups = raw.get("groups")
    check(isinstance(groups, list) and len(groups) > 0, "study.groups must be a non-empty list")
    spec = StudySpec(path=p, name=name, budget=budget.strip(), out=out, report=report)
    spec.eval_tasks, spec.eval_limit, spec.eval_loss = _eval_section(raw.get("eval"))
    results = raw.get("results")
    check(results is None or (isinstance(results, str) and results.strip() != ""),
          f"study.results={results!r} must be a directory path (relative to the spec)")
    if results is not None:
        spec.results_dir = (p.parent / results).resolve()
    pending_match: list[tuple[RunSpec, str, str]] = []
    for gi, g in enumerate(groups):
        spec.runs.extend(_expand_group(g, gi, base, default_seeds, spec.groups, pending_match))
    names: dict[str, RunSpec] = {}
    for r in spec.runs:
        check(r.name not in names, f"study.groups: two runs are named {r.name!r} (groups "
              f"{names.get(r.name).group if r.name in names else '?'} and {r.group}); give a "
              "group a label: template such as 'flops-{label}'")
        names[r.name] = r
    labels = {(r.label, r.seed): r.name for r in spec.runs}
    for r, target, where in pending_match:
        check((target, r.seed) in labels, f"{where}={target!r} names no run label of the study "
              f"with seed {r.seed} (labels: {', '.join(sorted({lab for lab, _ in labels}))})")
        dep = labels[(target, r.seed)]
        check(dep != r.name, f"{where}={target!r} names the run itself")
        if where.endswith(".init_from_run"):
            r.init_of = dep
        else:
            check(dep not in r.match_of, f"{where}: {target!r} is named twice")
            r.match_of += (dep,)
    spec.ordered()  # cycle check
    if validate:
        validate_runs(spec.runs)
    return spec


def _init_label(entry: dict, where: str) -> str | None:
    """``init_from_run: LABEL`` of a group or run entry (None: not given)."""
    init = entry.get("init_from_run")
    check(init is None or (isinstance(init, str) and init.strip() != ""),
          f"{where}.init_from_run={init!r} must be a run label")
    return init


def _entry_name(entry: Any, where: str, allowed: tuple[str, ...], key: str, taken: Any,
                shape: str, reuse: str) -> str:
    """The cleaned ``entry[key]`` of a group (key ``name``) or of one of its runs (``label``),
    after checking that ``entry`` is a mapping of ``allowed`` keys that gives ``key`` a name not
    in ``taken``; ``shape`` and ``reuse`` end the two messages that differ between the kinds."""
    check(isinstance(entry, dict), f"{where} must be {shape}")
    for k in entry:
        check(k in allowed, f"unknown key {where}.{k} (allowed: {', '.join(allowed)})")
    check(key in entry, f"{where}.{key} is required")
    name = clean_name(str(entry[key]), f"{where}.{key}")
    check(name not in taken, f"{where}.{key}={name!r} is used {reuse}")
    return name


def _expand_group(g: Any, gi: int, base: dict, default_seeds: list[int], group_names: list[str],
                  pending_match: list) -> list[RunSpec]:
    where = f"study.groups[{gi}]"
    gname = _entry_name(g, where, GROUP_KEYS, "name", group_names, "a mapping",
                        "by another group")
    group_names.append(gname)
    where = f"study.groups[{gname}]"
    common = dotted(g.get("set"), f"{where}.set")
    grid = dotted(g.get("grid"), f"{where}.grid")
    for key, values in grid.items():
        check(isinstance(values, list) and len(values) > 0, f"{where}.grid.{key}={values!r} "
              "must be a non-empty list of values")
        check(len({repr(v) for v in values}) == len(values),
              f"{where}.grid.{key}={values!r} has a repeated value")
    explicit = g.get("runs")
    if explicit is not None:
        check(isinstance(explicit, list) and len(explicit) > 0,
              f"{where}.runs must be a non-empty list of {{label, set}}")
    seeds = seed_list(g["seeds"], f"{where}.seeds") if "seeds" in g else default_seeds
    stop = stop_rule(g.get("stop"), f"{where}.stop")
    match = g.get("match_flops_of")
    if match is not None:
        if isinstance(match, str):
            match = [match]
        check(isinstance(match, list) and match != [] and all(
            isinstance(m, str) and m.strip() != "" for m in match),
            f"{where}.match_flops_of={g.get('match_flops_of')!r} must be a run label or a "
            "list of run labels")
        check(stop is None, f"{where}: give either stop or match_flops_of, not both")
    group_init = _init_label(g, where)
    template = g.get("label")
    check(template is None or (isinstance(template, str) and template.strip() != ""),
          f"{where}.label={template!r} must be a label template such as 'flops-{{label}}'")

    items: list[tuple[str, dict[str, Any], str | None]] = []  # (label, overrides, init label)
    if explicit is None:
        items.append(("", {}, group_init))
    else:
        taken = set()
        for ri, r in enumerate(explicit):
            rw = f"{where}.runs[{ri}]"
            lab = _entry_name(r, rw, RUN_KEYS, "label", taken, "a mapping with label and set",
                              "twice in the group")
            taken.add(lab)
            items.append((lab, dotted(r.get("set"), f"{rw}.set"), _init_label(r, rw)
                          or group_init))
    points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] or [{}]

    out = []
    for lab, run_set, init in items:
        for point in points:
            overrides = {**common, **point, **run_set}
            auto = "-".join(x for x in (lab, auto_label(point)) if x) or gname
            config = merge(base, overrides)
            if template:
                auto = _format(template, f"{where}.label", config, label=auto, seed="")
            label = clean_name(auto, f"{where}.label")
            for seed in seeds:
                cfg = copy.deepcopy(config)
                name = f"{label}-s{seed}"
                run = RunSpec(name=name, label=label, group=gname, seed=seed,
                              overrides=overrides, config=cfg, stop=stop)
                for m in match or ():
                    target = _format(m, f"{where}.match_flops_of", config, label=label,
                                     seed=seed)
                    pending_match.append((run, target, f"{where}.match_flops_of"))
                if init is not None:
                    check("train.init_from" not in overrides, f"{where}: give either "
                          "init_from_run or train.init_from, not both")
                    pending_match.append((run, init, f"{where}.init_from_run"))
                out.append(run)
    return out
