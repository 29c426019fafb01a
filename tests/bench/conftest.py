"""Loading a developer script of ``scripts/`` (not a package) as a module, for its tests."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="session")
def load_script():
    """``load_script("name")``: ``scripts/name.py`` as a module (its ``main`` does not run)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
