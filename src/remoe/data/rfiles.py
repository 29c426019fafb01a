"""R's file containers around a serialization: ``.rds`` files (``saveRDS``: gzip, bzip2, xz or
none) and lazy-load databases (``.rdx`` index + ``.rdb`` records), as R packages ship their
data. The serialization itself is decoded by :mod:`remoe.data.rserialize`."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path
from typing import Any

from remoe.data.rserialize import VECSXP, RFormatError, RObject, unserialize


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
