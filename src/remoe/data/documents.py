"""The unit of the corpus: a :class:`Document` (domain, key, text), and text normalisation."""

from __future__ import annotations

from dataclasses import dataclass

SPLITS: tuple[str, ...] = ("train", "validation", "test")


@dataclass(frozen=True)
class Document:
    """One document of the corpus.

    ``domain`` is its Pile-style set name (``code``, ``prose``, ...); ``key`` identifies it
    uniquely and stably inside its domain (a relative path, a book name, ``file:line``); the
    train/validation/test split is a hash of ``(domain, key)``, so a document keeps its split
    as long as its key does.
    """

    domain: str
    key: str
    text: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def decode_text(data: bytes) -> str:
    """Decode file bytes: UTF-8 (BOM stripped) or, failing that, Latin-1; normalise newlines.

    NUL characters are dropped and ``\\r\\n`` / ``\\r`` become ``\\n``, so the same file always
    gives the same text whatever platform wrote it.
    """
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return normalize_text(text)


def normalize_text(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", "")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def looks_binary(data: bytes) -> bool:
    """True for bytes that are clearly not text (NULs in the first 8 KiB)."""
    return b"\x00" in data[:8192]
