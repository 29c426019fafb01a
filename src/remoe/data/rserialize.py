"""A small pure-Python reader of R's serialization format and of the file containers around it:
``.rds`` files (``saveRDS``: gzip, bzip2, xz or none) and lazy-load databases.

R packages ship their data sets as a *lazy-load database*: ``Rdata.rdx`` is an RDS file (an
optionally gzip/bzip2/xz-compressed serialization) holding a named list
``list(variables=list(name=c(offset, length), ...), references=..., compressed=TRUE)`` and
``Rdata.rdb`` holds, at each ``offset``, ``length`` bytes: a 4-byte big-endian uncompressed size
followed by a zlib stream (``compressed=TRUE``) -- or, for ``compressed`` 2/3, a type byte and a
bzip2/xz stream -- of one serialized object.

Only what data sets of plain vectors need is read: the XDR ("X\\n") serialization, versions 2
and 3; logical, integer, double, character and list vectors with their attributes; pairlists,
symbols, references, and the compact/wrapper ALTREP forms R writes for such vectors. Anything
else (environments, closures, byte code, ...) raises :class:`RFormatError` naming its type.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SEXP types read here (R's Rinternals.h), and the serialization's pseudo types
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP, ATTRLISTSXP, ALTREP_SXP = 255, 254, 239, 238

_NA_INT = -(2**31)
# CHARSXP encoding flags (in the "levels" bits of the flags word)
_BYTES_MASK, _LATIN1_MASK, _UTF8_MASK, _ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6


class RFormatError(ValueError):
    """The bytes are not a serialization this reader understands."""


@dataclass
class RObject:
    """A decoded R object: its SEXP type, a Python value and its attributes.

    ``value`` is a ``list`` for vectors (``None`` for NA elements of logical, integer and
    character vectors) and a list of ``(tag, value)`` pairs for pairlists.
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

    def header(self) -> None:
        fmt = bytes(self._take(2))
        if fmt != b"X\n":
            kind = {b"A\n": "ASCII", b"B\n": "native binary"}.get(fmt, repr(fmt))
            raise RFormatError(f"only XDR R serializations are supported (got {kind})")
        version = self.int()
        self._take(8)  # the writer's and the minimal reader's R versions
        if version == 3:
            enc = bytes(self._take(self.int())).decode("ascii", "replace").strip()
            try:  # the writer's native encoding, where Python knows it (else UTF-8)
                self.native_encoding = codecs.lookup(enc).name
            except LookupError:
                pass
        elif version != 2:
            raise RFormatError(f"unsupported R serialization version {version}")

    def item(self, flags: int | None = None) -> Any:
        flags = self.int() if flags is None else flags
        t = flags & 0xFF
        if t == NILVALUE_SXP:
            return None
        if t == REFSXP:
            idx = (flags >> 8) or self.int()
            if not 1 <= idx <= len(self.refs):
                raise RFormatError(f"bad reference index {idx}")
            return self.refs[idx - 1]
        if t == SYMSXP:
            name = self.item()  # a CHARSXP
            sym = "NA" if name is None else name
            self.refs.append(sym)
            return sym
        if t in (LISTSXP, ATTRLISTSXP):
            return self.pairlist(flags)
        if t == ALTREP_SXP:
            return self.altrep()
        if t == CHARSXP:
            return self.charsxp(flags >> 12)
        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals: Any = [None if v == _NA_INT else v
                         for v in struct.unpack(f">{n}i", self._take(4 * n))]
            if t == LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
        elif t == REALSXP:
            n = self.length()
            vals = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif t in (STRSXP, VECSXP):
            vals = [self.item() for _ in range(self.length())]
        else:
            raise RFormatError(f"R objects of SEXP type {t} (at byte {self.pos - 4}) are not read "
                               "here: only vectors, lists and pairlists")
        obj = RObject(t, vals)
        if flags & (1 << 9):  # has attributes
            obj.attributes = _pairlist_to_attrs(self.item())
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

    def pairlist(self, flags: int) -> RObject:
        """A pairlist, read iteratively along its CDRs to avoid deep recursion."""
        head = RObject(LISTSXP, [])
        while True:
            attr = self.item() if flags & (1 << 9) or flags & 0xFF == ATTRLISTSXP else None
            if attr is not None and not head.value:
                head.attributes = _pairlist_to_attrs(attr)
            tag = self.item() if flags & (1 << 10) else None
            head.value.append((None if tag is None else str(tag), self.item()))
            flags = self.int()
            if flags & 0xFF not in (LISTSXP, ATTRLISTSXP):
                tail = self.item(flags)
                if tail is not None:
                    head.value.append((".cdr", tail))
                return head

    def altrep(self) -> Any:
        info, state, attr = self.item(), self.item(), self.item()
        cls = str(info.value[0][1]) if isinstance(info, RObject) and info.value else ""
        if cls in ("compact_intseq", "compact_realseq") and isinstance(state, RObject):
            n, start, inc = state.value[:3]
            t, cast = (INTSXP, int) if cls == "compact_intseq" else (REALSXP, float)
            obj = RObject(t, [cast(start + i * inc) for i in range(int(n))])
        elif cls.startswith("wrap_") and isinstance(state, RObject):
            inner = state.value[0]
            obj = RObject(inner.sexptype, inner.value, dict(inner.attributes))
        else:
            raise RFormatError(f"unsupported ALTREP class {cls!r}")
        if attr is not None:
            obj.attributes = _pairlist_to_attrs(attr)
        return obj


def _pairlist_to_attrs(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, RObject) or obj.sexptype != LISTSXP:
        raise RFormatError("attributes are not a pairlist")
    return {str(tag): value for tag, value in obj.value if tag is not None and tag != ".cdr"}


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
