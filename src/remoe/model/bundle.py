"""The model's code, bundled into a saved model directory (``trust_remote_code`` without remoe).

A saved directory must load with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` in a Python that has torch and transformers but not remoe. The code
it needs is *generated* here from this package's sources, never kept as a second copy (one
generation per process while the sources stay the same: every save reads them again, and
regenerates when any file of the package changed):

* the modules :mod:`remoe.model.config` and :mod:`remoe.model.llama` need (their ``remoe`` imports,
  lazy ones included, and the ``"remoe.x.y:Class"`` names of :mod:`remoe.model.registry`) are copied
  as flat files: ``configuration_remoe.py`` (``remoe.model.config``), ``modeling_remoe.py``
  (``remoe.model.llama``) and ``remoe_<dotted_path>.py`` for the rest (``remoe_model_moe.py``);
* their imports are rewritten to relative ones (``from remoe.model.moe import X`` ->
  ``from .remoe_model_moe import X``; ``from remoe import registry`` ->
  ``from . import remoe_registry as registry``), registry names to ``".remoe_model_...:Class"``
  and ``importlib.import_module(name)`` to ``importlib.import_module(name, __package__)``;
* the two entry files end with an ``if False:`` block naming every other file, because
  transformers copies (and downloads from the Hub) only the files it finds in ``from .x
  import`` lines;
* ``config.json`` gets ``auto_map`` pointing at the two entry classes.

Anything that cannot be rewritten (``import remoe.x``, a ``remoe`` module outside the package
files) raises: a bundle is complete or not written. In the bundled copy itself (loaded by
transformers, ``__name__`` outside ``remoe``), :func:`write_code` copies its sibling files, so
a model loaded with ``trust_remote_code`` saves a complete directory too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

CONFIG_FILE = "configuration_remoe"
MODELING_FILE = "modeling_remoe"
#: config.json ``auto_map``: the classes transformers' Auto* load from the bundled files
AUTO_MAP = {"AutoConfig": f"{CONFIG_FILE}.ReMoEConfig",
            "AutoModelForCausalLM": f"{MODELING_FILE}.ReMoEForCausalLM"}
#: tokenizer files copied from the source directory of a loaded model by save_pretrained
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_PKG = "remoe"
# entry modules (relative to the package) -> their file names in the bundle
_ENTRIES = {"model.config": CONFIG_FILE, "model.llama": MODELING_FILE}
_REF = re.compile(r"^remoe((?:\.\w+)+)(:\w+)?$")  # a string naming a package module
_BUNDLE_FILE = re.compile(r"^(configuration_remoe|modeling_remoe|remoe_\w+)\.py$")


def _in_package() -> bool:
    """True in remoe itself; False in a bundled copy loaded by transformers."""
    return __name__.split(".")[0] == _PKG


def _package_root() -> Path:
    return Path(__file__).resolve().parents[1]


#: ``((module name, path relative to the package's parent, source), ...)``, sorted
Snapshot = tuple[tuple[str, str, str], ...]


def _snapshot() -> Snapshot:
    """Every module file of the package, read now (a few ms): what a bundle is generated from.
    A module ``remoe.a.b`` is ``a/b.py``, else ``a/b/__init__.py``; a file whose path is no
    module name (an editor's ``.#x.py`` lock link) is not one."""
    root = _package_root()
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.parts[:-1] if rel.name == "__init__.py" else (*rel.parts[:-1], rel.stem)
        if not all(part.isidentifier() for part in parts) or not path.is_file():
            continue
        name = ".".join((_PKG, *parts))
        if name not in found or rel.name != "__init__.py":  # a.py before a/__init__.py
            found[name] = ((Path(_PKG) / rel).as_posix(), path.read_text(encoding="utf-8"))
    return tuple((n, *found[n]) for n in sorted(found))


def flat_name(name: str) -> str:
    """File stem of package module ``name`` in the bundle."""
    rel = name[len(_PKG) + 1:] if name.startswith(_PKG + ".") else ""
    if rel in _ENTRIES:
        return _ENTRIES[rel]
    if not rel:
        raise ValueError(f"cannot bundle the package {_PKG!r} itself")
    return f"{_PKG}_{rel.replace('.', '_')}"


def _refs(tree: ast.AST, where: str, modules: set[str]) -> set[str]:
    """Package modules a module uses: its imports (lazy ones too) and registry names."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == _PKG:
                    raise ValueError(f"{where}: 'import {a.name}' cannot be bundled; use "
                                     f"'from {a.name.rsplit('.', 1)[0]} import ...'")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == _PKG:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _REF.match(node.value)
            if m and _PKG + m.group(1) in modules:
                found.add(_PKG + m.group(1))
    for name in found:
        if name not in modules:
            raise ValueError(f"{where}: {name} is not a module file of the package")
    return found


def _modules(sources: dict[str, str]) -> dict[str, ast.Module]:
    """Every module the entry modules need (transitively), parsed from ``sources`` (module
    name -> source)."""
    todo = [f"{_PKG}.{e}" for e in _ENTRIES]
    trees: dict[str, ast.Module] = {}
    names = set(sources)
    while todo:
        name = todo.pop()
        if name in trees:
            continue
        if name not in sources:
            raise ValueError(f"{name} is not a module file of the package")
        trees[name] = ast.parse(sources[name], name)
        todo.extend(sorted(_refs(trees[name], name, names) - trees.keys()))
    flats = [flat_name(n) for n in trees]
    if len(set(flats)) != len(flats):
        raise ValueError(f"two package modules share a bundle file name: {sorted(flats)}")
    return trees


def _rewrite(name: str, src: str, text: str, tree: ast.Module, bundled: set[str]) -> str:
    """``text`` (module ``name``, file ``src``) with its package imports, registry names and
    import_module calls rewritten."""
    data = text.encode("utf-8")
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def span(node: ast.AST) -> tuple[int, int]:
        return (starts[node.lineno - 1] + node.col_offset,
                starts[node.end_lineno - 1] + node.end_col_offset)

    edits: list[tuple[int, int, str]] = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # never touch f-string pieces
            skip.update(id(v) for v in ast.walk(node))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == _PKG:
            attrs, parts = [], []
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in bundled:
                    parts.append(f"from . import {flat_name(sub)} as {a.asname or a.name}")
                else:
                    attrs.append(a.name + (f" as {a.asname}" if a.asname else ""))
            if attrs:
                parts.insert(0, f"from .{flat_name(node.module)} import {', '.join(attrs)}")
            edits.append((*span(node), "; ".join(parts)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "import_module" and isinstance(node.func.value, ast.Name) and \
                node.func.value.id == "importlib" and len(node.args) == 1 and not node.keywords:
            a, b = span(node.args[0])
            edits.append((a, b, data[a:b].decode("utf-8") + ", __package__"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in skip:
            m = _REF.match(node.value)
            if m and _PKG + m.group(1) in bundled:
                edits.append((*span(node), repr(f".{flat_name(_PKG + m.group(1))}"
                                                 f"{m.group(2) or ''}")))
    edits.sort()
    for (a0, b0, _), (a1, _, _) in zip(edits, edits[1:]):
        if a1 < b0:
            raise ValueError(f"{name}: overlapping rewrites at byte {a1}")
    out = data
    for a, b, new in reversed(edits):
        out = out[:a] + new.encode("utf-8") + out[b:]
    header = (f"# Generated from {src} by remoe.model.bundle when this model was saved: the "
              "package's own code,\n# with its imports rewritten for this flat directory. Do "
              "not edit (saving regenerates it).\n")
    result = header + out.decode("utf-8")
    if flat_name(name) in _ENTRIES.values():
        others = sorted(flat_name(n) for n in bundled if flat_name(n) != flat_name(name)
                        and flat_name(n) != MODELING_FILE)
        result += ("\n\nif False:  # the other files of this bundle, named so that transformers"
                   " copies them (never run)\n"
                   + "".join(f"    from .{o} import __name__  # noqa: F401\n" for o in others))
    for node in ast.walk(ast.parse(result)):  # nothing may still import the package
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if any(m and m.split(".")[0] == _PKG for m in mods):
                raise ValueError(f"{name}: an import of {_PKG} is left after rewriting")
    return result


def bundle_sources() -> dict[str, str]:
    """``{file name: source}`` of the bundle (generated from the package, or, in a bundled copy,
    its sibling files)."""
    if not _in_package():
        here = Path(__file__).resolve().parent
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(here.iterdir())
                if _BUNDLE_FILE.match(p.name)}
    return dict(_generate(_snapshot()))


@functools.lru_cache(maxsize=1)
def _generate(snapshot: Snapshot) -> tuple[tuple[str, str], ...]:
    """The bundle's ``(file name, source)`` pairs, from ``snapshot`` alone (:func:`_snapshot`):
    a pure function of the sources, kept for the next save while they stay the same (parsing
    and rewriting them cost ~0.2-0.3 s per save on a 2-core AMD EPYC VM)."""
    sources = {name: text for name, _, text in snapshot}
    files = {name: src for name, src, _ in snapshot}
    trees = _modules(sources)
    bundled = set(trees)
    return tuple((f"{flat_name(n)}.py", _rewrite(n, files[n], sources[n], t, bundled))
                 for n, t in sorted(trees.items()))


def write_code(directory: str | os.PathLike) -> list[str]:
    """Write the bundle into ``directory`` (which holds ``config.json``) and add ``auto_map``
    to its config; returns the file names written."""
    d = Path(directory)
    files = bundle_sources()
    for old in d.iterdir():  # a previous save's files that the bundle no longer has
        if _BUNDLE_FILE.match(old.name) and old.name not in files:
            old.unlink()
    for fname, text in files.items():
        (d / fname).write_text(text, encoding="utf-8")
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["auto_map"] = {**(cfg.get("auto_map") or {}), **AUTO_MAP}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sorted(files)


CARD_FILE = "README.md"
CHECKSUMS_FILE = "checksums.json"  # remoe.rundir.MANIFEST


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process umask (read from
    /proc/self/status where it is, so no other thread sees the umask change)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(directory: str | os.PathLike) -> None:
    """``checksums.json``: size and sha256 of every other file under ``directory`` (the format
    :func:`remoe.rundir.verify_manifest` checks)."""
    d = Path(directory)
    files = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != CHECKSUMS_FILE:
            files[p.relative_to(d).as_posix()] = {"size": p.stat().st_size,
                                                  "sha256": file_sha256(p)}
    (d / CHECKSUMS_FILE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def finish_save(model, directory: str | os.PathLike) -> None:
    """After ``save_pretrained``: the code and ``auto_map``; from the directory the model was
    loaded from, its tokenizer files and its model card when ``directory`` has none; the saved
    files readable as the umask allows (transformers writes the weights 0600); last,
    ``checksums.json`` regenerated when the source directory or ``directory`` had one.

    A new model card describes the run a model came from, which the model does not know: the
    callers that save (remoe train's ``write_model_dir``, ``remoe convert``, ``ReMoETrainer``)
    write it afterwards (:mod:`remoe.rundir.card`)."""
    d = Path(directory)
    had_checksums = (d / CHECKSUMS_FILE).is_file()
    write_code(d)
    src = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if src.is_dir() and src.resolve() != d.resolve():
        if not any((d / f).exists() for f in TOKENIZER_FILES):
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copyfile(src / f, d / f)
        if (src / CARD_FILE).is_file() and not (d / CARD_FILE).exists():
            shutil.copyfile(src / CARD_FILE, d / CARD_FILE)
        had_checksums = had_checksums or (src / CHECKSUMS_FILE).is_file()
    mode = new_file_mode()
    for p in d.iterdir():
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) != mode and (
                p.suffix in (".safetensors", ".json", ".py") or p.name == CARD_FILE):
            os.chmod(p, mode)
    if had_checksums:
        write_checksums(d)
