"""Study specs: one YAML expanded into a list of named training runs (see docs/STUDY.md).

A spec holds a ``budget`` (text), a base experiment (``base_config: file.yaml`` and/or ``base:``
sections, as in ``remoe train`` configs) and ``groups``. Each group expands to runs:

* ``set``: dotted overrides common to the group (``model.num_experts: 32``);
* ``grid``: dotted key -> list of values, expanded as a cartesian product (first key slowest);
* ``runs``: explicit labelled override sets (``- {label: pi, set: {model.lambda_update: pi}}``),
  each crossed with the grid when both are given;
* ``seeds``: the seeds every labelled run is repeated with (default ``[0]``);
* a stop rule: ``stop: {steps|tokens|flops: X}``, or ``match_flops_of: LABEL``: stop at the
  training FLOPs the run LABEL (same seed) spent, read from its ``summary.json`` once finished.

Overrides apply in the order base < group ``set`` < grid point < explicit run ``set``. A run's
label is the explicit run's label and/or the grid values in short form (``relu-E32``, see
:func:`auto_label`), or the group's ``label:`` template (``str.format`` with ``{label}``,
``{seed}`` and the resolved config as ``{model.num_experts}`` ...); its name is
``<label>-s<seed>``. Every expanded config is validated with
:func:`remoe.train.config.load_config` before anything runs; errors are one-line
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

from remoe.errors import ConfigError
from remoe.study.runconfig import validate_runs

SPEC_KEYS = ("name", "budget", "base_config", "base", "groups", "seeds", "out", "report", "eval")
EVAL_KEYS = ("tasks", "limit")
GROUP_KEYS = ("name", "set", "grid", "runs", "seeds", "stop", "match_flops_of", "label")
RUN_KEYS = ("label", "set")
STOP_KEYS = ("steps", "tokens", "flops")
SECTIONS = ("run", "model", "data", "train", "analysis")
#: run.* fields the study owns (name, directory and seed of every run)
OWNED = ("run.name", "run.out_dir", "run.seed")
#: short forms of grid keys in automatic labels: prefix + value ("" = the value alone)
SHORT = {"model.router": "", "model.reg_type": "", "model.sparsity_control": "",
         "model.lambda_update": "", "model.num_experts": "E", "model.top_k": "k",
         "model.granularity": "G", "model.lambda0": "lambda0_", "model.alpha": "alpha",
         "model.max_active": "cap", "train.lr": "lr", "train.max_steps": "steps"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


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
    match_of: str | None = None  # the name of the run whose FLOPs this one matches

    def describe_overrides(self, skip: tuple[str, ...] = ()) -> str:
        return " ".join(f"{k}={_fmt_value(v)}" for k, v in self.overrides.items() if k not in skip)

    def describe_stop(self) -> str:
        if self.match_of:
            return f"flops of {self.match_of}"
        if self.stop:
            (k, v), = self.stop.items()
            return f"{k} {v:.3g}" if k == "flops" else f"{k} {int(v)}"
        return f"steps {self.config['train'].get('max_steps', 'default')}"


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
    groups: list[str] = field(default_factory=list)

    def by_name(self) -> dict[str, RunSpec]:
        return {r.name: r for r in self.runs}

    def ordered(self) -> list[RunSpec]:
        """Runs in spec order, except that a run named by ``match_flops_of`` comes before the
        runs that match it (a stable topological order)."""
        by = self.by_name()
        out: list[RunSpec] = []
        seen: set[str] = set()

        def visit(r: RunSpec, trail: tuple[str, ...]) -> None:
            if r.name in seen:
                return
            _check(r.name not in trail, "study: match_flops_of forms a cycle: "
                   + " -> ".join(trail + (r.name,)))
            if r.match_of:
                visit(by[r.match_of], trail + (r.name,))
            seen.add(r.name)
            out.append(r)

        for r in self.runs:
            visit(r, ())
        return out


# ----------------------------------------------------------------------------- small helpers

def _eval_section(raw: Any) -> tuple[str | None, int | None]:
    """``eval: {tasks: builtin, limit: 300}``: zero-shot tasks run on every finished run."""
    if raw is None:
        return None, None
    _check(isinstance(raw, dict), f"study.eval={raw!r} must be a mapping with tasks (and limit)")
    for k in raw:
        _check(k in EVAL_KEYS, f"unknown key study.eval.{k} (allowed: {', '.join(EVAL_KEYS)})")
    tasks, limit = raw.get("tasks"), raw.get("limit")
    _check(isinstance(tasks, str) and tasks.strip() not in ("", "none"),
           f"study.eval.tasks={tasks!r} must name tasks as `remoe eval --tasks` does "
           "(e.g. builtin)")
    _check(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0),
           f"study.eval.limit={limit!r} must be a positive integer (examples per task)")
    return tasks.strip(), limit


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def auto_label(point: dict[str, Any]) -> str:
    """``{"model.router": "relu", "model.num_experts": 32}`` -> ``relu-E32``."""
    parts = []
    for key, v in point.items():
        last = key.split(".")[-1]
        if isinstance(v, bool):
            parts.append(last if v else f"no_{last}")
            continue
        prefix = SHORT.get(key, "" if isinstance(v, str) else last)
        parts.append(f"{prefix}{_fmt_value(v)}")
    return "-".join(parts)


def _clean_name(text: str, where: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_.+=-]", "_", text)
    _check(bool(_NAME.match(text)), f"{where}={text!r} must be a non-empty name "
           "(letters, digits, _ . + = -)")
    return text


def _dotted(mapping: Any, where: str) -> dict[str, Any]:
    """Check a mapping of ``section.key`` -> value."""
    if mapping is None:
        return {}
    _check(isinstance(mapping, dict), f"{where} must be a mapping of section.key: value")
    for key in mapping:
        parts = str(key).split(".")
        _check(len(parts) == 2 and all(parts), f"{where}.{key}: keys must be section.key "
               "(e.g. model.num_experts)")
        _check(parts[0] in SECTIONS, f"{where}.{key}: unknown section {parts[0]!r} (allowed: "
               f"{', '.join(SECTIONS)})")
        _check(key not in OWNED, f"{where}.{key}: set by the study (run names, directories and "
               "seeds come from the spec)")
    return dict(mapping)


def _seeds(value: Any, where: str) -> list[int]:
    _check(isinstance(value, list) and len(value) > 0, f"{where}={value!r} must be a non-empty "
           "list of integers")
    for s in value:
        _check(isinstance(s, int) and not isinstance(s, bool) and s >= 0,
               f"{where}={value!r} must hold integers >= 0")
    _check(len(set(value)) == len(value), f"{where}={value!r} has a repeated seed")
    return list(value)


def _positive(v: Any) -> float | None:
    if isinstance(v, str):  # YAML reads 1e12 (no dot) as a string
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def _stop(value: Any, where: str) -> dict[str, float] | None:
    if value is None:
        return None
    _check(isinstance(value, dict) and len(value) == 1, f"{where}={value!r} must be one of "
           "{steps: N}, {tokens: N}, {flops: X}")
    (k, v), = value.items()
    _check(k in STOP_KEYS, f"{where}.{k}: unknown stop rule (allowed: {', '.join(STOP_KEYS)})")
    x = _positive(v)
    _check(x is not None, f"{where}.{k}={v!r} must be a positive number")
    if k in ("steps", "tokens"):
        _check(float(x).is_integer(), f"{where}.{k}={v!r} must be an integer")
    return {k: x}


def _merge(base: dict[str, dict[str, Any]], overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = copy.deepcopy(value)
    return out


def _sections(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    _check(isinstance(raw, dict), f"{where} must be a mapping of sections ({', '.join(SECTIONS)})")
    out = {}
    for k, v in raw.items():
        _check(k in SECTIONS, f"{where}: unknown section {k!r} (allowed: {', '.join(SECTIONS)})")
        _check(v is None or isinstance(v, dict), f"{where}.{k} must be a mapping")
        out[k] = dict(v or {})
    return out


def _namespace(config: dict[str, dict[str, Any]]) -> dict[str, SimpleNamespace]:
    """Sections as attribute namespaces for label templates; ``model`` with every default."""
    from remoe.config import PRESETS, ReMoEConfig

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
    _check(p.is_file(), f"spec={str(p)!r} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"spec={str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    _check(isinstance(raw, dict), f"spec={str(p)!r} must be a mapping")
    _check("groups" in raw or not set(raw) & set(SECTIONS),
           f"spec={str(p)!r} is a remoe train config (sections {', '.join(SECTIONS)}), not a "
           "study spec: a spec names it with base_config: (see docs/STUDY.md)")
    for k in raw:
        _check(k in SPEC_KEYS, f"unknown key study.{k} (allowed: {', '.join(SPEC_KEYS)})")
    budget = raw.get("budget")
    _check(isinstance(budget, str) and budget.strip() != "", "study.budget must state the "
           "budget of the study as text (e.g. '2 seeds x 10 runs, ~40 CPU-minutes')")
    name = _clean_name(str(raw.get("name") or p.stem), "study.name")
    out = raw.get("out")
    _check(out is None or isinstance(out, str), f"study.out={out!r} must be a path")
    report = raw.get("report", True)
    _check(isinstance(report, bool), f"study.report={report!r} must be true or false")

    base: dict[str, dict[str, Any]] = {}
    if raw.get("base_config") is not None:
        bc = raw["base_config"]
        _check(isinstance(bc, str), f"study.base_config={bc!r} must be a path")
        bp = (p.parent / bc) if not Path(bc).is_absolute() else Path(bc)
        _check(bp.is_file(), f"study.base_config={bc!r} does not exist (relative to the spec)")
        try:
            base = _sections(yaml.safe_load(bp.read_text()) or {}, "study.base_config")
        except yaml.YAMLError as e:
            raise ConfigError(f"study.base_config={bc!r} is not valid YAML: "
                              f"{str(e).splitlines()[0]}") from None
    for section, values in _sections(raw.get("base") or {}, "study.base").items():
        base.setdefault(section, {}).update(values)
    for k in ("name", "out_dir", "seed"):
        base.get("run", {}).pop(k, None)  # the study names, places and seeds every run
    # data.cache_dir relative to the working directory, as `remoe train` reads it
    from remoe.data.config import DEFAULT_CACHE_DIR

    data = base.setdefault("data", {})
    data["cache_dir"] = str(Path(data.get("cache_dir") or DEFAULT_CACHE_DIR).resolve())

    default_seeds = _seeds(raw["seeds"], "study.seeds") if "seeds" in raw else [0]
    groups = raw.get("groups")
    _check(isinstance(groups, list) and len(groups) > 0, "study.groups must be a non-empty list")
    spec = StudySpec(path=p, name=name, budget=budget.strip(), out=out, report=report)
    spec.eval_tasks, spec.eval_limit = _eval_section(raw.get("eval"))
    pending_match: list[tuple[RunSpec, str, str]] = []
    for gi, g in enumerate(groups):
        spec.runs.extend(_expand_group(g, gi, base, default_seeds, spec.groups, pending_match))
    names: dict[str, RunSpec] = {}
    for r in spec.runs:
        _check(r.name not in names, f"study.groups: two runs are named {r.name!r} (groups "
               f"{names.get(r.name).group if r.name in names else '?'} and {r.group}); give a "
               "group a label: template such as 'flops-{label}'")
        names[r.name] = r
    labels = {(r.label, r.seed): r.name for r in spec.runs}
    for r, target, where in pending_match:
        _check((target, r.seed) in labels, f"{where}={target!r} names no run label of the study "
               f"with seed {r.seed} (labels: {', '.join(sorted({lab for lab, _ in labels}))})")
        r.match_of = labels[(target, r.seed)]
        _check(r.match_of != r.name, f"{where}={target!r} names the run itself")
    spec.ordered()  # cycle check
    if validate:
        validate_runs(spec)
    return spec


def _entry_name(entry: Any, where: str, allowed: tuple[str, ...], key: str, taken: Any,
                shape: str, reuse: str) -> str:
    """The cleaned ``entry[key]`` of a group (key ``name``) or of one of its runs (``label``),
    after checking that ``entry`` is a mapping of ``allowed`` keys that gives ``key`` a name not
    in ``taken``; ``shape`` and ``reuse`` end the two messages that differ between the kinds."""
    _check(isinstance(entry, dict), f"{where} must be {shape}")
    for k in entry:
        _check(k in allowed, f"unknown key {where}.{k} (allowed: {', '.join(allowed)})")
    _check(key in entry, f"{where}.{key} is required")
    name = _clean_name(str(entry[key]), f"{where}.{key}")
    _check(name not in taken, f"{where}.{key}={name!r} is used {reuse}")
    return name


def _expand_group(g: Any, gi: int, base: dict, default_seeds: list[int], group_names: list[str],
                  pending_match: list) -> list[RunSpec]:
    where = f"study.groups[{gi}]"
    gname = _entry_name(g, where, GROUP_KEYS, "name", group_names, "a mapping",
                        "by another group")
    group_names.append(gname)
    where = f"study.groups[{gname}]"
    common = _dotted(g.get("set"), f"{where}.set")
    grid = _dotted(g.get("grid"), f"{where}.grid")
    for key, values in grid.items():
        _check(isinstance(values, list) and len(values) > 0, f"{where}.grid.{key}={values!r} "
               "must be a non-empty list of values")
        _check(len({repr(v) for v in values}) == len(values),
               f"{where}.grid.{key}={values!r} has a repeated value")
    explicit = g.get("runs")
    if explicit is not None:
        _check(isinstance(explicit, list) and len(explicit) > 0,
               f"{where}.runs must be a non-empty list of {{label, set}}")
    seeds = _seeds(g["seeds"], f"{where}.seeds") if "seeds" in g else default_seeds
    stop = _stop(g.get("stop"), f"{where}.stop")
    match = g.get("match_flops_of")
    if match is not None:
        _check(isinstance(match, str) and match.strip() != "",
               f"{where}.match_flops_of={match!r} must be a run label")
        _check(stop is None, f"{where}: give either stop or match_flops_of, not both")
    template = g.get("label")
    _check(template is None or (isinstance(template, str) and template.strip() != ""),
           f"{where}.label={template!r} must be a label template such as 'flops-{{label}}'")

    items: list[tuple[str, dict[str, Any]]] = []  # (explicit label, overrides)
    if explicit is None:
        items.append(("", {}))
    else:
        taken = set()
        for ri, r in enumerate(explicit):
            rw = f"{where}.runs[{ri}]"
            lab = _entry_name(r, rw, RUN_KEYS, "label", taken, "a mapping with label and set",
                              "twice in the group")
            taken.add(lab)
            items.append((lab, _dotted(r.get("set"), f"{rw}.set")))
    points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] or [{}]

    out = []
    for lab, run_set in items:
        for point in points:
            overrides = {**common, **point, **run_set}
            auto = "-".join(x for x in (lab, auto_label(point)) if x) or gname
            config = _merge(base, overrides)
            if template:
                auto = _format(template, f"{where}.label", config, label=auto, seed="")
            label = _clean_name(auto, f"{where}.label")
            for seed in seeds:
                cfg = copy.deepcopy(config)
                name = f"{label}-s{seed}"
                run = RunSpec(name=name, label=label, group=gname, seed=seed,
                              overrides=overrides, config=cfg, stop=stop)
                if match is not None:
                    target = _format(match, f"{where}.match_flops_of", config, label=label,
                                     seed=seed)
                    pending_match.append((run, target, f"{where}.match_flops_of"))
                out.append(run)
    return out
