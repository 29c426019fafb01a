"""R lazy-load databases (janeaustenr's ``Rdata.rdb``): the container read by remoe, the
serializations by the ``rdata`` library."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

import pytest

from remoe.data.builtin import austen_db_base, read_austen_books
from remoe.data.errors import DataError
from remoe.data.rlazyload import read_lazyload_db, read_lazyload_names

# -- a tiny hand-written XDR serializer (only what the tests need) -----------------------------

HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def header(version: int = 2) -> bytes:
    out = b"X\n" + i32(version) + i32(0x040201) + i32(0x020300)
    if version == 3:
        out += i32(5) + b"UTF-8"
    return out


def charsxp(s: str | None, enc: int = UTF8) -> bytes:
    if s is None:
        return i32(9) + i32(-1)
    raw = s.encode("latin-1" if enc == LATIN1 else "utf-8")
    return i32(9 | (enc << 12)) + i32(len(raw)) + raw


def strsxp(values: list[str | None], attrs: bytes = b"") -> bytes:
    flags = 16 | (HAS_ATTR if attrs else 0)
    return i32(flags) + i32(len(values)) + b"".join(charsxp(v) for v in values) + attrs


def intsxp(values: list[int]) -> bytes:
    return i32(13) + i32(len(values)) + b"".join(i32(v) for v in values)


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name, ASCII)


def names_attr(names: list[str], sym: bytes) -> bytes:
    """A one-element attribute pairlist ``names = names`` (``sym``: symbol or reference)."""
    return i32(2 | HAS_TAG) + sym + strsxp(names) + i32(254)


def vecsxp(items: list[bytes], names: list[str] | None = None, sym: bytes | None = None) -> bytes:
    flags = 19 | (HAS_ATTR if names is not None else 0)
    out = i32(flags) + i32(len(items)) + b"".join(items)
    if names is not None:
        out += names_attr(names, sym if sym is not None else symbol("names"))
    return out


REF1 = i32((1 << 8) | 255)  # reference to the first symbol read ("names")


def write_lazyload_db(base: Path, objects: dict[str, bytes], compressed: int = 1) -> None:
    """``base.rdb`` with each serialized object and ``base.rdx`` (gzip RDS) indexing them."""
    rdb = b""
    positions = []
    for payload in objects.values():
        if compressed == 1:
            blob = struct.pack(">I", len(payload)) + zlib.compress(payload)
        elif compressed == 2:
            blob = struct.pack(">I", len(payload)) + b"2" + bz2.compress(payload)
        else:
            blob = struct.pack(">I", len(payload)) + b"X" + lzma.compress(payload)
        positions.append(intsxp([len(rdb), len(blob)]))
        rdb += blob
    names = list(objects)
    index = vecsxp(
        [
            vecsxp(positions, names),  # reads the "names" symbol first: reference 1
            vecsxp([], [], sym=REF1),
            i32(13) + i32(1) + i32(compressed),
        ],
        ["variables", "references", "compressed"],
        sym=REF1,
    )
    base.with_name(base.name + ".rdb").write_bytes(rdb)
    base.with_name(base.name + ".rdx").write_bytes(gzip.compress(header(3) + index))


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [1, 2, 3])
def test_lazyload_db_roundtrip(tmp_path, compressed):
    base = tmp_path / "Rdata"
    books = {"first": ["Chapter 1", "", "It was a dark night."], "second": ["Only", None, "lines"]}
    objects = {k: header(2) + strsxp(v) for k, v in books.items()}
    objects["third"] = header(3) + i32(16) + i32(3) + charsxp("plain", ASCII) + (
        charsxp("café ünïcode", UTF8)) + charsxp("naïve", LATIN1)
    objects["numbers"] = header(2) + intsxp([1, 2, 3])  # not text: the Austen reader skips it
    write_lazyload_db(base, objects, compressed)
    assert read_lazyload_names(base) == ["first", "second", "third", "numbers"]
    db = read_lazyload_db(base)
    assert list(db) == ["first", "second", "third", "numbers"]
    assert list(db["first"]) == books["first"]
    assert list(db["numbers"]) == [1, 2, 3]
    # the Austen reader on the same layout: NA lines become empty strings, encodings decoded
    assert read_austen_books(base) == {"first": books["first"], "second": ["Only", "", "lines"],
                                       "third": ["plain", "café ünïcode", "naïve"]}


def test_lazyload_names_do_not_read_the_records(tmp_path):
    base = tmp_path / "Rdata"
    write_lazyload_db(base, {"x": header() + strsxp(["abc"])})
    base.with_name("Rdata.rdb").unlink()
    assert read_lazyload_names(base) == ["x"]


def test_lazyload_db_detects_bad_length(tmp_path):
    base = tmp_path / "Rdata"
    write_lazyload_db(base, {"x": header() + strsxp(["abc"])})
    rdb = base.with_name("Rdata.rdb")
    data = bytearray(rdb.read_bytes())
    data[0:4] = struct.pack(">I", 999)  # header size no longer matches the payload
    rdb.write_bytes(bytes(data))
    with pytest.raises(DataError, match="header says 999"):
        read_lazyload_db(base)


@pytest.mark.parametrize("damage", ["stream", "foreign", "outside", "index"])
def test_damaged_database_is_one_line_naming_the_file(tmp_path, damage):
    # a damaged record fails the codec's checksum (zlib, bzip2, xz); a cut file points outside
    base = tmp_path / "Rdata"
    good = header() + strsxp(["hello"])
    write_lazyload_db(base, {"x": b"A\n" + good[2:] if damage == "foreign" else good})
    rdb = base.with_name("Rdata.rdb")
    data = bytearray(rdb.read_bytes())
    if damage == "stream":
        data[len(data) // 2 + 2] ^= 0xFF
    if damage == "outside":
        data = data[:3]
    rdb.write_bytes(bytes(data))
    if damage == "index":
        base.with_name("Rdata.rdx").write_bytes(gzip.compress(header() + strsxp(["no list"])))
    with pytest.raises(DataError) as err:
        read_lazyload_db(base)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path) in msg
    assert ("Rdata.rdx" if damage == "index" else "variable 'x'") in msg


@pytest.mark.skipif(austen_db_base() is None, reason="r-cran-janeaustenr is not installed")
def test_installed_austen_books():
    books = read_austen_books()
    assert sorted(books) == ["emma", "mansfieldpark", "northangerabbey", "persuasion",
                             "prideprejudice", "sensesensibility"]
    pp = "\n".join(books["prideprejudice"])
    assert pp.startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged, that a single man in possession" in pp
    assert len(books["prideprejudice"]) > 10_000
