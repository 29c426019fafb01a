"""A config's values from YAML: each checked against the type of the dataclass field it fills
(ints accepted for floats, YAML's ``1e-3`` string read as a float, NaN refused), a section built
and validated from a mapping, and ``--set section.key=value`` parsed. Problems are one
:class:`~remoe.errors.ConfigError` line naming the field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import yaml

from remoe import safeyaml
from remoe.errors import check


def check_finite(obj: Any, section: str) -> None:
    """Every float field of a config dataclass is finite (NaN passes every comparison check)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            check(math.isfinite(v), f"{section}.{f.name}={v!r} must be a finite number")


_SIMPLE = {"int": int, "float": float, "str": str, "bool": bool}


def coerce(value: Any, type_str: str, where: str) -> Any:
    """Check ``value`` against a dataclass annotation string; ints are accepted for floats."""
    t = type_str.replace(" ", "")
    optional = t.endswith("|None") or t.startswith("Optional[")
    t = t.removesuffix("|None")
    if value is None:
        check(optional, f"{where}=null is not allowed (expected {t})")
        return None
    if t.startswith("list["):
        inner = t[5:-1]
        check(isinstance(value, list), f"{where}={value!r} must be a list of {inner}")
        return [coerce(v, inner, where) for v in value]
    if t == "Any":
        return value
    py = _SIMPLE.get(t)
    if py is None:
        return value
    if py is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        check(math.isfinite(value), f"{where}={value!r} must be a finite number")
        return float(value)
    if py is float and isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
        try:
            f = float(value)
        except ValueError:
            pass
        else:
            check(math.isfinite(f), f"{where}={value!r} must be a finite number")
            return f
    ok = isinstance(value, py) and not (py is int and isinstance(value, bool))
    check(ok, f"{where}={value!r} must be of type {t}")
    return value


def build_section(cls, values: dict[str, Any], section: str):
    check(isinstance(values, dict), f"{section} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        check(key in fields, f"unknown key {section}.{key} (allowed: {', '.join(fields)})")
        kwargs[key] = coerce(value, str(fields[key].type), f"{section}.{key}")
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], YAML-parsed value)."""
    check("=" in text, f"--set {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    check(len(path) == 2 and all(path), f"--set {text!r}: key must be section.key (e.g. "
          "model.num_experts=16)")
    try:
        value = safeyaml.load_text(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = _plain_list(raw)
    return path, value


def _plain_list(raw: str) -> Any:
    """A ``[a, b]`` that YAML refuses (a source spec's ``?text=c&domain=s`` reads as YAML's
    complex-key marker) as the list of its comma-separated items, as written; else ``raw``."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]" and "[" not in text[1:-1]:
        return [item.strip() for item in text[1:-1].split(",") if item.strip()]
    return raw



def short(v: Any, n: int = 60) -> str:
    import reprlib

    r = reprlib.Repr()  # bounded: never walks more of a big value than it shows
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 6, 6, n, n
    text = r.repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."
