"""R's lazy-load database, where an R package keeps its data sets (``janeaustenr``'s novels).

``Rdata.rdx`` is an RDS file holding ``list(variables=list(name=c(offset, length), ...),
references=..., compressed=...)``. ``Rdata.rdb`` holds, at each ``offset``, ``length`` bytes: the
object's serialized size (4 bytes, big-endian), then its serialization compressed with zlib
(``compressed`` 1), or, for ``compressed`` 2 and 3, a type byte and a zlib (``Z``), bzip2
(``2``), xz (``X``) or uncompressed (``0``) stream. The container is read here; the
serializations are parsed by the ``rdata`` library, which reads structure only and evaluates
nothing.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

from remoe.data.errors import DataError

_STREAMS = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress,
            b"0": lambda b: b}


def _parse(data: bytes, where: str) -> Any:
    """One R serialization (compressed or not) as Python values, with a one-line error."""
    import rdata

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" on every record
            return rdata.conversion.convert(rdata.parser.parse_data(data))
    except Exception as e:  # the parser raises what its reads hit: ValueError, struct.error...
        raise DataError(f"{where}: not a readable R serialization ({type(e).__name__}: {e})")


def _record(blob: bytes, compressed: int, where: str) -> bytes:
    if compressed == 0:
        return blob
    size = struct.unpack(">I", blob[:4])[0] if len(blob) >= 4 else None
    kind, stream = (b"Z", blob[4:]) if compressed == 1 else (blob[4:5], blob[5:])
    if size is None or kind not in _STREAMS:
        raise DataError(f"{where}: not a lazy-load record (compression type {kind!r})")
    try:
        out = _STREAMS[kind](stream)
    except (zlib.error, OSError, lzma.LZMAError) as e:
        raise DataError(f"{where}: cannot decompress ({e})")
    if len(out) != size:
        raise DataError(f"{where}: {len(out)} bytes decompressed, the header says {size}")
    return out


def _index(base: Path) -> dict[str, Any]:
    rdx = base.with_name(base.name + ".rdx")
    index = _parse(rdx.read_bytes(), str(rdx))
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise DataError(f"{rdx}: not a lazy-load index (no 'variables' list)")
    return index


def read_lazyload_db(base: str | Path) -> dict[str, Any]:
    """Every variable of ``base.rdx`` + ``base.rdb``, in index order, as ``rdata`` converts
    it (a character vector is a numpy array of ``str``, its NAs ``None``).

    ``base`` is the path without extension, e.g. ``.../janeaustenr/data/Rdata``.
    """
    base = Path(base)
    index, rdb_path = _index(base), base.with_name(base.name + ".rdb")
    flag = index.get("compressed")
    compressed = 1 if flag is None or len(flag) == 0 else int(flag[0])
    rdb = rdb_path.read_bytes()
    out: dict[str, Any] = {}
    for name, pos in index["variables"].items():
        off, length = (int(x) for x in pos[:2])
        where = f"{rdb_path} (variable {str(name)!r})"
        if off < 0 or length < 0 or off + length > len(rdb):
            raise DataError(f"{where}: points outside the file")
        out[str(name)] = _parse(_record(rdb[off: off + length], compressed, where), where)
    return out


def read_lazyload_names(base: str | Path) -> list[str]:
    """The variable names of ``base.rdx``, without reading ``base.rdb``."""
    return [str(n) for n in _index(Path(base))["variables"]]
