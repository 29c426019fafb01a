"""The package layout is the architecture: every group of modules imports only
the groups below it, no module imports a module that imports it back, no package reaches into
another's private names, and no module outside the model spells a router's name to decide
something (routers declare what they do; remoe.model.registry reads the declarations).

Imports inside functions count (they run too); imports under ``if TYPE_CHECKING:`` do not.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "remoe"

#: group -> the groups its modules may import (besides their own). A group is a package
#: (``remoe.model``) or a top-level module (``remoe.errors``). Commands sit on top: each
#: package's ``cli.py`` and ``remoe/cli.py`` may import anything.
ALLOWED = {
    "errors": set(),
    "fileio": set(),  # atomic writes, for every package that writes files
    "lazy": set(),  # PEP 562 lazy public names of the light packages
    "safeyaml": {"errors"},
    "configfields": {"errors", "safeyaml"},  # YAML values onto a config's dataclass fields
    "model": {"errors", "lazy"},  # everything a saved model needs, its bundled code included
    "machine": {"errors"},
    "method": {"errors", "model"},
    "data": {"errors", "fileio", "lazy", "safeyaml"},
    "experiment": {"errors", "safeyaml", "configfields", "model", "data"},
    "configfile": {"errors", "experiment"},  # which experiment file a command reads
    "rundir": {"errors", "fileio", "model", "data", "experiment"},
    "distributed": {"errors", "model", "rundir"},
    "convert": {"errors", "model", "rundir"},
    "eval": {"errors", "fileio", "model", "method", "data", "rundir", "machine"},
    "analysis": {"errors", "lazy", "model", "method", "data", "rundir", "machine"},
    "train": {"errors", "fileio", "safeyaml", "model", "machine", "method", "data", "experiment",
              "rundir", "distributed", "convert"},
    "hf": {"errors", "model", "method", "data", "experiment", "rundir", "train"},
    # (bench/scale.py's torchrun worker runs the `remoe train` command: "cli")
    "bench": {"errors", "fileio", "model", "machine", "method", "data", "experiment", "rundir",
              "distributed", "train", "cli"},
    "study": {"errors", "fileio", "safeyaml", "model", "machine", "method", "data", "experiment",
              "rundir", "analysis", "bench", "train"},
    "__init__": {"errors", "lazy", "model", "method"},  # `import remoe`: lazy public names
    "lab": set(),  # remoe/lab/__init__.py: the lab's docstring, nothing imported
}
#: modules that name routers because that is their subject: the converters write a `topk` or
#: `relu` model and upcycle a `dense` one, the router swap turns softmax weights into ReLU ones,
#: the benchmarks' rows are named methods
NAMES_ALLOWED = {"convert/from_hf.py", "convert/upcycle.py", "train/init_from.py",
                 "lab/bench/layer.py", "lab/bench/gpu.py", "lab/bench/gpu_check.py",
                 "lab/bench/memory_plan.py", "lab/bench/model.py"}


def _group(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    if parts[0] == "lab":  # remoe.lab.<package>: each lab package is a group of its own
        return "lab" if parts[1] == "__init__.py" else parts[1].removesuffix(".py")
    return parts[0].removesuffix(".py")


def _target(mod: str) -> str:
    """The group a module name ``remoe.x...`` (or ``remoe.lab.x...``) belongs to."""
    parts = mod.split(".")
    if len(parts) == 1:  # `from remoe import X`: the lazy public names of remoe
        return "__init__"
    if parts[1] == "lab":
        return parts[2] if len(parts) > 2 else "lab"
    return parts[1]


def _is_command(path: Path) -> bool:
    return path.name == "cli.py" or path.relative_to(SRC).as_posix() == "datacli.py"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    base = SRC.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every remoe import of ``path`` (``from remoe.x import y`` with
    ``remoe.x.y`` a module counts as an import of that module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "remoe":
            subs = [f"{node.module}.{a.name}" for a in node.names]
            mods = [s for s in subs if _exists(s)]
            plain = [a.name for a, s in zip(node.names, subs) if not _exists(s)]
            out += [(m, []) for m in mods]
            if plain or not mods:
                out.append((node.module, plain))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "remoe"]
    return out


def _files():
    return sorted(SRC.rglob("*.py"))


def test_every_group_has_a_row():
    groups = {_group(f) for f in _files() if not (f.parent == SRC and _is_command(f))}
    assert groups == set(ALLOWED), groups ^ set(ALLOWED)


def test_groups_import_only_the_groups_below_them():
    bad = []
    for f in _files():
        if _is_command(f):
            continue
        g = _group(f)
        for mod, _ in imports(f):
            target = _target(mod)
            if target != g and target not in ALLOWED[g] and not (target == "__init__"):
                bad.append(f"{f.relative_to(SRC)} ({g}) imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules():
    graph = {}
    for f in _files():
        me = _module_name(f)
        graph[me] = {m for m, _ in imports(f) if _exists(m) and m != me}
    # packages import their __init__ implicitly: an edge to a package counts as to its __init__
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_private_imports_across_packages():
    bad = []
    for f in _files():
        g = _group(f)
        for mod, names in imports(f):
            parts = mod.split(".")
            other = _target(mod)
            private = [n for n in names if n.startswith("_")] + \
                [p for p in parts[2:] if p.startswith("_") and p != "__init__"]
            if private and other != g:
                bad.append(f"{f.relative_to(SRC)} imports {private} from {mod}")
    assert not bad, "\n".join(bad)


def test_no_router_names_outside_the_model():
    from remoe.model import registry

    names = set(registry.BUILTINS)
    bad = []
    for f in _files():
        rel = f.relative_to(SRC).as_posix()
        if rel.startswith("model/") or rel in NAMES_ALLOWED:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            consts = [c for c in [node.left, *node.comparators] for c in ast.walk(c)
                      if isinstance(c, ast.Constant) and c.value in names]
            if consts:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_saved_model_code_is_the_model_package():
    """The bundled code of a saved model is remoe.model's modules plus remoe.errors."""
    from remoe.model.bundle import _modules, _snapshot

    mods = set(_modules({name: text for name, _, text in _snapshot()}))
    assert all(m.startswith("remoe.model.") or m == "remoe.errors" for m in mods), mods


#: the lab: the paper's measurements, benchmarks and studies, built on the library
LAB = {"analysis", "bench", "study"}


def test_the_library_never_imports_the_lab():
    """Two layers: no library group may import a lab group (the import check above enforces
    each group's ALLOWED set, so this keeps the sets themselves honest)."""
    library = set(ALLOWED) - LAB
    assert {g: ALLOWED[g] & LAB for g in library if ALLOWED[g] & LAB} == {}
    assert LAB <= set(ALLOWED) and all((SRC / "lab" / g).is_dir() for g in LAB)
    # and the layout says so: the lab packages live under remoe/lab/, nothing else does
    assert {p.name for p in (SRC / "lab").iterdir() if p.is_dir() and p.name != "__pycache__"} \
        == LAB
