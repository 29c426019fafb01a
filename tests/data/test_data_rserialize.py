"""The pure-Python R serialization / lazy-load database reader."""

from __future__ import annotations

import bz2
import gzip
import struct
import zlib
from pathlib import Path

import pytest

from remoe.data.builtin import austen_db_base, read_austen_books
from remoe.data.rserialize import read_lazyload_db, read_rds
from remoe.data.rserialize import INTSXP, LISTSXP, STRSXP, VECSXP, RFormatError, unserialize

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
        else:
            blob = struct.pack(">I", len(payload)) + b"2" + bz2.compress(payload)
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


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_character_vector(version):
    blob = header(version) + i32(16) + i32(4) + charsxp("plain", ASCII) + charsxp(None) + (
        charsxp("café ünïcode", UTF8)) + charsxp("naïve", LATIN1)
    obj = unserialize(blob)
    assert obj.sexptype == STRSXP
    assert obj.value == ["plain", None, "café ünïcode", "naïve"]
    assert obj.attributes == {}


def test_unserialize_named_list_with_symbol_reference():
    # the nested list's names attribute is read first and defines the symbol; the outer
    # list's names attribute refers back to it (REFSXP)
    blob = header() + vecsxp(
        [strsxp(["a", "b"]), intsxp([1, -(2**31), 3]), vecsxp([intsxp([7])], ["inner"])],
        ["letters", "numbers", "nested"], sym=REF1)
    obj = unserialize(blob)
    assert obj.sexptype == VECSXP
    d = obj.to_dict()
    assert d["letters"].value == ["a", "b"]
    assert d["numbers"].sexptype == INTSXP and d["numbers"].value == [1, None, 3]
    assert d["nested"].to_dict()["inner"].value == [7]


def test_unserialize_long_pairlist_is_iterative():
    n = 5000  # deeper than Python's recursion limit if read recursively
    cells = b"".join(i32(2 | HAS_TAG) + symbol(f"t{i}") + intsxp([i]) for i in range(n))
    obj = unserialize(header() + cells + i32(254))
    assert obj.sexptype == LISTSXP
    assert len(obj.value) == n
    assert obj.value[-1][0] == f"t{n - 1}"
    assert obj.value[1234][1].value == [1234]


def test_truncated_or_foreign_data_raises():
    good = header() + strsxp(["hello"])
    with pytest.raises(RFormatError):
        unserialize(good[:-2])
    with pytest.raises(RFormatError):
        unserialize(b"A\n" + good[2:])
    with pytest.raises(RFormatError, match="SEXP type 4 "):  # an environment: not a data vector
        unserialize(header() + i32(4) + i32(0) + i32(254) * 4)


@pytest.mark.parametrize("compressed", [1, 2])
def test_lazyload_db_roundtrip(tmp_path, compressed):
    base = tmp_path / "Rdata"
    books = {"first": ["Chapter 1", "", "It was a dark night."], "second": ["Only", None, "lines"]}
    write_lazyload_db(base, {k: header(2) + strsxp(v) for k, v in books.items()}, compressed)
    index = read_rds(base.with_name("Rdata.rdx"))
    assert sorted(index.to_dict()) == ["compressed", "references", "variables"]
    db = read_lazyload_db(base)
    assert list(db) == ["first", "second"]
    assert db["first"].value == books["first"]
    assert db["second"].value == ["Only", None, "lines"]
    # the Austen reader on the same layout: NA lines become empty strings
    assert read_austen_books(base) == {"first": books["first"], "second": ["Only", "", "lines"]}


def test_lazyload_db_detects_bad_length(tmp_path):
    base = tmp_path / "Rdata"
    write_lazyload_db(base, {"x": header() + strsxp(["abc"])})
    rdb = base.with_name("Rdata.rdb")
    data = bytearray(rdb.read_bytes())
    data[0:4] = struct.pack(">I", 999)  # header size no longer matches the payload
    rdb.write_bytes(bytes(data))
    with pytest.raises(RFormatError, match="header says 999"):
        read_lazyload_db(base)


@pytest.mark.skipif(austen_db_base() is None, reason="r-cran-janeaustenr is not installed")
def test_installed_austen_books():
    books = read_austen_books()
    assert sorted(books) == ["emma", "mansfieldpark", "northangerabbey", "persuasion",
                             "prideprejudice", "sensesensibility"]
    pp = "\n".join(books["prideprejudice"])
    assert pp.startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged, that a single man in possession" in pp
    assert len(books["prideprejudice"]) > 10_000
