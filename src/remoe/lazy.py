"""Public names that load on first use (PEP 562), for the packages whose import must stay light
(``remoe``, ``remoe.model``, ``remoe.data``, ``remoe.lab.analysis``, ``remoe.eval``)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, table: dict[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``table`` is imported from the
    module it maps to when first read; any other unknown name raises AttributeError."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    return __getattr__, __dir__
