"""Token strings for tables: quoting, escapes, byte pieces, no tokenizer."""

from __future__ import annotations

from tokenizers import Tokenizer

from remoe.lab.analysis.model_analyses import BYTE_OF_CHAR, TokenNames


def test_token_names(remoe_run):
    path = remoe_run / "final" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    names = TokenNames(path)
    assert names.available
    nl = tok.token_to_id("Ċ")  # the byte-level symbol of "\n"
    assert names(nl) == r"'\n'" and names.text(nl) == "\n"
    the = tok.encode(" the").ids
    assert len(the) == 1 and names(the[0]) == "' the'"
    lone = tok.token_to_id("©")  # byte 0xA9 alone is not UTF-8
    assert names(lone) == r"b'\xa9'" and names.text(lone) == "<0xA9>"
    assert TokenNames(None)(5) == "#5" and TokenNames(remoe_run / "nope.json").text(5) == "#5"


def test_byte_alphabet_is_a_bijection():
    assert len(BYTE_OF_CHAR) == 256 and sorted(BYTE_OF_CHAR.values()) == list(range(256))
    assert BYTE_OF_CHAR["A"] == 65 and BYTE_OF_CHAR["Ġ"] == 32 and BYTE_OF_CHAR["Ċ"] == 10
