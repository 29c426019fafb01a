"""No package imports upward (issue 13): the run-directory reading, stage detection and the
losses live in neutral modules, so train, eval and analysis never import each other."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "remoe"

# package -> packages it must never import (at module level or inside functions)
FORBIDDEN = {
    "train": ("remoe.eval", "remoe.analysis", "remoe.study", "remoe.bench"),
    "eval": ("remoe.train", "remoe.analysis", "remoe.study", "remoe.bench"),
    "analysis": ("remoe.train", "remoe.eval", "remoe.study", "remoe.bench"),
    "model": ("remoe.train", "remoe.eval", "remoe.analysis", "remoe.data", "remoe.study",
              "remoe.bench"),
}
# neutral low modules: nothing above the model and data
LOW = {"errors.py", "registry.py", "rundir.py", "runlock.py", "runfiles.py", "loading.py",
       "dcpread.py",
       "stages.py", "losses.py", "sparsity.py", "threads.py", "config.py"}
ABOVE = ("remoe.train", "remoe.eval", "remoe.analysis", "remoe.study", "remoe.bench", "remoe.cli")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_packages_do_not_import_upward():
    bad = []
    for pkg, banned in FORBIDDEN.items():
        for f in (SRC / pkg).rglob("*.py"):
            bad += [f"{f.relative_to(SRC)} imports {m}" for m in imports(f)
                    if m.startswith(banned)]
    assert not bad, bad


def test_neutral_modules_import_nothing_above_them():
    bad = [f"{name} imports {m}" for name in LOW for m in imports(SRC / name) if m.startswith(ABOVE)]
    assert not bad, bad
