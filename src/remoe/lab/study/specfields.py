"""The field checks of a study spec: names, dotted overrides, seeds, stop rules, sections.
Each raises :class:`remoe.errors.ConfigError` with a one-line message naming the field."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

from remoe.errors import check
from remoe.experiment import SECTIONS

STOP_KEYS = ("steps", "tokens", "flops")
OWNED = ("run.name", "run.out_dir", "run.seed")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


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
