"""Readable token strings for tables and figures (the run's ``tokenizer.json``)."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType


class TokenNames:
    """``names(id)`` -> a quoted, escaped token string such as ``' the'`` or ``'\\n'``.

    Without a tokenizer every token is shown as ``#<id>``. A byte-level piece that is not
    valid UTF-8 on its own (part of a multi-byte character) is shown as its bytes.
    """

    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self.tok = None
        if tokenizer_path is not None and Path(tokenizer_path).is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(tokenizer_path))

    @property
    def available(self) -> bool:
        return self.tok is not None

    def _piece(self, token_id: int) -> str | bytes:
        """Decoded text, or the raw bytes of a byte-level piece that is not valid UTF-8."""
        s = self.tok.decode([int(token_id)], skip_special_tokens=False)
        if s and "\ufffd" not in s:
            return s
        raw = self.tok.id_to_token(int(token_id)) or f"#{token_id}"
        if all(c in BYTE_OF_CHAR for c in raw):
            return bytes(BYTE_OF_CHAR[c] for c in raw)
        return raw

    def text(self, token_id: int) -> str:
        """The decoded text of one token (unquoted; byte pieces as ``<0xE2 0x80>``)."""
        if self.tok is None:
            return f"#{token_id}"
        p = self._piece(token_id)
        return p if isinstance(p, str) else "<" + " ".join(f"0x{b:02X}" for b in p) + ">"

    def __call__(self, token_id: int) -> str:
        """Quoted and escaped (``' the'``, ``'\\n'``); byte pieces as ``b'\\xe2\\x80'``."""
        if self.tok is None:
            return f"#{token_id}"
        return repr(self._piece(token_id))


def _byte_level_alphabet() -> MappingProxyType:
    """Inverse of the byte-level BPE alphabet: printable Latin-1 bytes stand for themselves,
    every other byte b is the character 256 + (its rank among those bytes)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {chr(b): b for b in keep}
    others = [b for b in range(256) if b not in set(keep)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return MappingProxyType(table)


BYTE_OF_CHAR = _byte_level_alphabet()


def mpl_safe(s: str) -> str:
    """Escape matplotlib mathtext (``$``) so token strings render literally."""
    return s.replace("$", r"\$")
