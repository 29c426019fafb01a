"""The field checks of the model config sections (:mod:`remoe.model.spec`): each raises
:class:`remoe.errors.ConfigError` with one line naming the field."""

from __future__ import annotations

import math
from typing import Any

from remoe.errors import check


def is_real(v: Any) -> bool:
    """A finite int/float that is not a bool (YAML `true` must not pass as 1)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_ints(obj: Any, names: tuple[str, ...], p: str) -> None:
    for name in names:
        v = getattr(obj, name)
        check(is_int(v) and v >= 1, f"{p}{name}={v!r} must be a positive integer")


def nonnegative_reals(obj: Any, names: tuple[str, ...], p: str) -> None:
    for name in names:
        v = getattr(obj, name)
        check(is_real(v) and v >= 0, f"{p}{name}={v!r} must be a finite number >= 0")


def bools(obj: Any, names: tuple[str, ...], p: str) -> None:
    for name in names:
        v = getattr(obj, name)
        check(isinstance(v, bool), f"{p}{name}={v!r} must be true or false")


def one_of(obj: Any, name: str, allowed: tuple[str, ...], p: str) -> None:
    v = getattr(obj, name)
    check(v in allowed, f"{p}{name}={v!r} must be one of {', '.join(allowed)}")
