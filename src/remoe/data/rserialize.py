"""A small pure-Python reader of R's serialization format and of the file containers around it:
``.rds`` files (``saveRDS``: gzip, bzip2, xz or none) and lazy-load databases.

R packages ship their data sets as a *lazy-load database*: ``Rdata.rdx`` is an RDS file (an
optionally gzip/bzip2/xz-compressed serialization) holding a named list
``list(variables=list(name=c(offset, length), ...), references=..., compressed=TRUE)`` and
``Rdata.rdb`` holds, at each ``offset``, ``length`` bytes: a 4-byte big-endian uncompressed size
followed by a zlib stream (``compressed=TRUE``) -- or, for ``compressed`` 2/3, a type byte and a
bzip2/xz stream -- of one serialized object.

Only the XDR ("X\\n") serialization, versions 2 and 3, is read. Vectors (logical, integer,
double, complex, character, raw, list), pairlists, symbols, references and environments are
decoded; closures, language objects and the like are decoded structurally so that a data
object containing them still parses. Byte code is not supported (:class:`RFormatError`).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SEXP types
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
SPECIALSXP, BUILTINSXP, CHARSXP, LGLSXP, INTSXP, REALSXP = 7, 8, 9, 10, 13, 14
CPLXSXP, STRSXP, DOTSXP, VECSXP, EXPRSXP, BCODESXP = 15, 16, 17, 19, 20, 21
EXTPTRSXP, WEAKREFSXP, RAWSXP, S4SXP = 22, 23, 24, 25
# pseudo types used only in serialized streams
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP = 255, 254, 253, 252
MISSINGARG_SXP, BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP = 251, 250, 249, 248
PERSISTSXP, CLASSREFSXP, GENERICREFSXP, BCREPDEF = 247, 246, 245, 244
EMPTYENV_SXP, BASEENV_SXP, ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 242, 241, 240, 239, 238

_NA_INT = -(2**31)
_PAIRLIST_TYPES = (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP)
_SPECIAL_VALUES = {
    GLOBALENV_SXP: "R_GlobalEnv",
    UNBOUNDVALUE_SXP: "R_UnboundValue",
    MISSINGARG_SXP: "R_MissingArg",
    BASENAMESPACE_SXP: "R_BaseNamespace",
    EMPTYENV_SXP: "R_EmptyEnv",
    BASEENV_SXP: "R_BaseEnv",
}
# CHARSXP encoding flags (in the "levels" bits of the flags word)
_BYTES_MASK, _LATIN1_MASK, _UTF8_MASK, _ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6


class RFormatError(ValueError):
    """The bytes are not a serialization this reader understands."""


class RSymbol(str):
    """An R symbol (a ``str`` holding its name)."""

    def __repr__(self) -> str:
        return f"RSymbol({str(self)!r})"


@dataclass
class RObject:
    """A decoded R object: its SEXP type, a Python value and its attributes.

    ``value`` is a ``list`` for vectors (``None`` for NA elements of logical, integer and
    character vectors), ``bytes`` for raw vectors, a list of ``(tag, value)`` pairs for
    pairlist-like objects, a dict for environments.
    """

    sexptype: int
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str | None] | None:
        n = self.attributes.get("names")
        return n.value if isinstance(n, RObject) else None

    def to_dict(self) -> dict[str, Any]:
        """A named vector/list as ``{name: element}`` (requires a ``names`` attribute)."""
        names = self.names
        if names is None or not isinstance(self.value, list):
            raise RFormatError("object has no names attribute")
        return {str(k): v for k, v in zip(names, self.value)}


class _Reader:
    def __init__(self, data: bytes):
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []
        self.native_encoding = "utf-8"

    # -- primitives -------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise RFormatError(f"truncated R serialization at byte {self.pos} (need {n})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self._take(8))
            n = (upper << 32) + lower
        elif n < -1:
            raise RFormatError(f"negative vector length {n}")
        return n

    def ints(self, n: int) -> list[int]:
        return list(struct.unpack(f">{n}i", self._take(4 * n)))

    def doubles(self, n: int) -> list[float]:
        return list(struct.unpack(f">{n}d", self._take(8 * n)))

    # -- header -----------------------------------------------------------------------------
    def header(self) -> int:
        fmt = bytes(self._take(2))
        if fmt != b"X\n":
            kind = {b"A\n": "ASCII", b"B\n": "native binary"}.get(fmt, repr(fmt))
            raise RFormatError(f"only XDR R serializations are supported (got {kind})")
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader R version
        if version == 3:
            nelen = self.int()
            enc = bytes(self._take(nelen)).decode("ascii", "replace")
            self.native_encoding = _python_encoding(enc)
        elif version != 2:
            raise RFormatError(f"unsupported R serialization version {version}")
        return version

    # -- items ------------------------------------------------------------------------------
    def item(self, flags: int | None = None) -> Any:
        if flags is None:
            flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if t == NILVALUE_SXP:
            return None
        if t in _SPECIAL_VALUES:
            return RObject(t, _SPECIAL_VALUES[t])
        if t == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            if not 1 <= idx <= len(self.refs):
                raise RFormatError(f"bad reference index {idx}")
            return self.refs[idx - 1]
        if t in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            obj = RObject(t, self.string_vec())
            self.refs.append(obj)
            return obj
        if t == SYMSXP:
            name = self.item()  # a CHARSXP
            sym = RSymbol(name if name is not None else "NA")
            self.refs.append(sym)
            return sym
        if t == ENVSXP:
            locked = self.int()
            env = RObject(ENVSXP, {"locked": bool(locked)})
            self.refs.append(env)
            env.value["enclos"] = self.item()
            env.value["frame"] = self.item()
            env.value["hashtab"] = self.item()
            attrib = self.item()
            env.attributes = _pairlist_to_attrs(attrib)
            return env
        if t in _PAIRLIST_TYPES:
            return self.pairlist(flags)
        if t == ALTREP_SXP:
            return self.altrep()
        if t == CHARSXP:
            return self.charsxp(levels)

        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals: Any = [None if v == _NA_INT else v for v in self.ints(n)]
            if t == LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
        elif t == REALSXP:
            vals = self.doubles(self.length())
        elif t == CPLXSXP:
            d = self.doubles(2 * self.length())
            vals = [complex(d[i], d[i + 1]) for i in range(0, len(d), 2)]
        elif t == STRSXP:
            n = self.length()
            vals = [self.item() for _ in range(n)]
        elif t in (VECSXP, EXPRSXP):
            n = self.length()
            vals = [self.item() for _ in range(n)]
        elif t == RAWSXP:
            vals = bytes(self._take(self.length()))
        elif t in (SPECIALSXP, BUILTINSXP):
            n = self.int()
            vals = bytes(self._take(n)).decode("latin-1")
        elif t == S4SXP:
            vals = None
        elif t == EXTPTRSXP:
            obj = RObject(t, {})
            self.refs.append(obj)
            obj.value["prot"] = self.item()
            obj.value["tag"] = self.item()
            if has_attr:
                obj.attributes = _pairlist_to_attrs(self.item())
            return obj
        elif t == WEAKREFSXP:
            obj = RObject(t, None)
            self.refs.append(obj)
            if has_attr:
                obj.attributes = _pairlist_to_attrs(self.item())
            return obj
        elif t in (BCODESXP, BCREPDEF, CLASSREFSXP, GENERICREFSXP):
            raise RFormatError(f"R byte code / class references (type {t}) are not supported")
        else:
            raise RFormatError(f"unknown SEXP type {t} at byte {self.pos - 4}")
        obj = RObject(t, vals)
        if has_attr:
            obj.attributes = _pairlist_to_attrs(self.item())
        del has_tag
        return obj

    def charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = bytes(self._take(n))
        if levels & _UTF8_MASK:
            return raw.decode("utf-8", "replace")
        if levels & (_LATIN1_MASK | _BYTES_MASK):
            return raw.decode("latin-1")
        if levels & _ASCII_MASK:
            return raw.decode("ascii", "replace")
        return raw.decode(self.native_encoding, "replace")

    def string_vec(self) -> list[str | None]:
        if self.int() != 0:
            raise RFormatError("names in persistent strings are not supported")
        n = self.int()
        return [self.item() for _ in range(n)]

    def pairlist(self, flags: int) -> RObject:
        """A pairlist-like chain, read iteratively along its CDRs to avoid deep recursion."""
        first_type = flags & 0xFF
        out_type = {ATTRLANGSXP: LANGSXP, ATTRLISTSXP: LISTSXP}.get(first_type, first_type)
        head = RObject(out_type, [])
        attrs_done = False
        while True:
            t = flags & 0xFF
            has_attr = bool(flags & (1 << 9)) or t in (ATTRLANGSXP, ATTRLISTSXP)
            has_tag = bool(flags & (1 << 10))
            attr = self.item() if has_attr else None
            if attr is not None and not attrs_done:
                head.attributes = _pairlist_to_attrs(attr)
            attrs_done = True
            tag = self.item() if has_tag else None
            car = self.item()
            head.value.append((None if tag is None else str(tag), car))
            flags = self.int()
            nt = flags & 0xFF
            if nt in (LISTSXP, ATTRLISTSXP) and out_type in (LISTSXP, LANGSXP, DOTSXP):
                continue  # the CDR is the next cell of the same chain (closures: body, no)
            tail = self.item(flags)
            if tail is not None:
                head.value.append((".cdr", tail))
            return head

    def altrep(self) -> Any:
        info = self.item()
        state = self.item()
        attr = self.item()
        cls = ""
        if isinstance(info, RObject) and info.value:
            cls = str(info.value[0][1])
        if cls == "compact_intseq" and isinstance(state, RObject):
            n, start, inc = (int(x) for x in state.value[:3])
            obj = RObject(INTSXP, [start + i * inc for i in range(n)])
        elif cls == "compact_realseq" and isinstance(state, RObject):
            n, start, inc = state.value[:3]
            obj = RObject(REALSXP, [start + i * inc for i in range(int(n))])
        elif cls.startswith("wrap_") and isinstance(state, RObject):
            inner = state.value[0]
            obj = RObject(inner.sexptype, inner.value, dict(inner.attributes))
        elif cls == "deferred_string" and isinstance(state, RObject):
            arg = state.value[0][1] if state.sexptype == LISTSXP else state.value[0]
            obj = RObject(STRSXP, [None if v is None else _r_number_string(v) for v in arg.value])
        else:
            raise RFormatError(f"unsupported ALTREP class {cls!r}")
        if attr is not None:
            obj.attributes = _pairlist_to_attrs(attr)
        return obj


def _r_number_string(v: Any) -> str:
    if isinstance(v, float):
        if math.isfinite(v) and v == int(v):
            return str(int(v))
        return repr(v)
    return str(v)


def _pairlist_to_attrs(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, RObject) or obj.sexptype != LISTSXP:
        raise RFormatError("attributes are not a pairlist")
    return {str(tag): value for tag, value in obj.value if tag is not None and tag != ".cdr"}


def _python_encoding(r_name: str) -> str:
    name = r_name.strip().lower()
    if name in ("utf-8", "utf8", ""):
        return "utf-8"
    if name in ("latin1", "iso-8859-1", "iso8859-1", "cp1252"):
        return "latin-1"
    try:
        "".encode(name)
    except LookupError:
        return "utf-8"
    return name


def unserialize(data: bytes) -> Any:
    """Decode one (uncompressed) XDR R serialization into Python values / :class:`RObject`."""
    r = _Reader(data)
    r.header()
    return r.item()


# -- the file containers --------------------------------------------------------------------------

def decompress_rds(data: bytes) -> bytes:
    """The serialization inside an RDS file: gzip, bzip2, xz or uncompressed."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    if len(data) > 5 and data[4:5] == b"\x78":  # R's own 4-byte-length + zlib framing
        return _decompress_lazyload_blob(data, 1)
    return data


def read_rds(path: str | Path) -> Any:
    """Read an ``.rds`` file (as written by ``saveRDS``)."""
    return unserialize(decompress_rds(Path(path).read_bytes()))


def _decompress_lazyload_blob(blob: bytes, compressed: int) -> bytes:
    if compressed == 0:
        return blob
    if len(blob) < 4:
        raise RFormatError("lazy-load record shorter than its header")
    size = struct.unpack(">I", blob[:4])[0]
    if compressed == 1:
        out = zlib.decompress(blob[4:])
    else:
        kind, payload = blob[4:5], blob[5:]
        if kind == b"Z":
            out = zlib.decompress(payload)
        elif kind == b"2":
            out = bz2.decompress(payload)
        elif kind == b"X":
            out = lzma.decompress(payload)
        elif kind == b"0":
            out = payload
        else:
            raise RFormatError(f"unknown lazy-load compression type {kind!r}")
    if len(out) != size:
        raise RFormatError(f"lazy-load record decompressed to {len(out)} bytes, header says {size}")
    return out


def read_lazyload_db(base: str | Path) -> dict[str, Any]:
    """All variables of the lazy-load database ``base.rdx`` + ``base.rdb``, in index order.

    ``base`` is the path without extension, e.g. ``.../janeaustenr/data/Rdata``.
    """
    base = Path(base)
    index = read_rds(base.with_name(base.name + ".rdx"))
    if not isinstance(index, RObject) or index.sexptype != VECSXP:
        raise RFormatError("lazy-load index is not a list")
    fields = index.to_dict()
    variables = fields.get("variables")
    if not isinstance(variables, RObject):
        raise RFormatError("lazy-load index has no 'variables'")
    comp = fields.get("compressed")
    compressed = 1
    if isinstance(comp, RObject) and comp.value:
        v = comp.value[0]
        compressed = int(v) if v is not None else 1
    rdb = base.with_name(base.name + ".rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, pos in variables.to_dict().items():
        off, length = (int(x) for x in pos.value[:2])
        if off < 0 or off + length > len(rdb):
            raise RFormatError(f"variable {name!r} points outside {base}.rdb")
        out[name] = unserialize(_decompress_lazyload_blob(rdb[off : off + length], compressed))
    return out
