"""Byte-level BPE tokenizers: training (deterministic), loading, saving, HF wrapping.

The trained tokenizer is GPT-2 style: byte-level pre-tokenization (no prefix space), BPE,
byte-level decoding, and one special token ``<|endoftext|>`` (id 0) that serves as EOS, BOS and
padding. No post-processor: encoding never inserts special tokens; the data pipeline appends
EOS after each document itself.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from remoe.data._io import sha256_file
from remoe.fileio import atomic_write_text, read_json

log = logging.getLogger("remoe.data")

EOS_TOKEN = "<|endoftext|>"
#: EOS candidates recognised in tokenizers loaded from elsewhere, in order of preference.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
MIN_VOCAB_SIZE = 256


def _byte_level_tokenizer(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(batches: Iterable[list[str]], vocab_size: int = 8192, *,
                    length: int | None = None, min_frequency: int = 2,
                    progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE tokenizer on an iterator of *batches* of texts.

    ``length`` only drives the progress bar: the number of *texts* (the bar counts the texts of
    each batch, not the batches). The result depends only
    on the texts and their order (training twice gives the same ``tokenizer.json``).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} must be >= {MIN_VOCAB_SIZE}")
    tok = _byte_level_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(batches, trainer=trainer, length=length)
    return tok


def batched_texts(texts: Iterable[str], batch_bytes: int = 1 << 20) -> Iterator[list[str]]:
    """Group texts into lists of about ``batch_bytes`` characters (never one giant string)."""
    batch: list[str] = []
    size = 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def find_eos(tok: Tokenizer) -> tuple[str, int] | None:
    """``(token, id)`` of the first known EOS token present in the vocabulary, if any."""
    for cand in EOS_CANDIDATES:
        i = tok.token_to_id(cand)
        if i is not None:
            return cand, i
    return None


def ensure_eos(tok: Tokenizer) -> tuple[str, int]:
    """Make sure ``tok`` has an EOS special token; add ``<|endoftext|>`` if it has none."""
    found = find_eos(tok)
    if found is None:
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        log.warning("tokenizer has no end-of-text token; added %s as id %d", EOS_TOKEN,
                    tok.token_to_id(EOS_TOKEN))
        found = (EOS_TOKEN, tok.token_to_id(EOS_TOKEN))
    else:
        # registered as special so it is never split and decode(skip_special_tokens) drops it
        tok.add_special_tokens([AddedToken(found[0], special=True, normalized=False)])
    return found


def _resolve_tokenizer_path(path: str | os.PathLike[str]) -> tuple[str, Path, Path | None]:
    p = Path(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return "json", p / "tokenizer.json", None
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return "gpt2", p / "vocab.json", p / "merges.txt"
        raise FileNotFoundError(f"{p} has neither tokenizer.json nor vocab.json + merges.txt")
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist")
    if p.name == "vocab.json" or p.suffix == ".json" and _looks_like_vocab(p):
        merges = p.with_name("merges.txt")
        if not merges.is_file():
            raise FileNotFoundError(f"{p} is a vocabulary but {merges} is missing")
        return "gpt2", p, merges
    return "json", p, None


def _looks_like_vocab(p: Path) -> bool:
    try:
        obj = json.loads(p.read_text("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "model" not in obj and all(
        isinstance(v, int) for v in list(obj.values())[:100])


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.json`` (file or directory) or a GPT-2 style
    ``vocab.json`` + ``merges.txt`` pair (the directory or the ``vocab.json`` path).

    GPT-2 files get byte-level pre-tokenization and decoding. An EOS token is ensured
    (``<|endoftext|>`` is added if the vocabulary has no known end-of-text token).
    """
    kind, a, b = _resolve_tokenizer_path(path)
    if kind == "json":
        tok = Tokenizer.from_file(str(a))
    else:
        assert b is not None
        tok = _byte_level_tokenizer(models.BPE.from_file(str(a), str(b)))
    ensure_eos(tok)
    return tok


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike[str]) -> str:
    """Write ``tokenizer.json`` atomically; returns its sha256."""
    atomic_write_text(path, tok.to_str(pretty=True))
    return sha256_file(path)


def tokenizer_vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can produce (max id + 1, including added tokens)."""
    return tok.get_vocab_size(with_added_tokens=True)


def load_hf_tokenizer(path: str | os.PathLike[str]):
    """A ``transformers.PreTrainedTokenizerFast`` wrapping a saved ``tokenizer.json``.

    ``path`` is the file or its directory (e.g. the data cache dir). EOS, BOS and padding are
    the tokenizer's end-of-text token; decoding does not "clean up" spaces, so
    ``decode(encode(text)) == text``.
    """
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if p.is_dir():
        store = p / "store-v2" / "manifest.json"  # a data cache dir: its sharded store's tokenizer
        m = read_json(store)
        p = (store.parent / m["dir"] if isinstance(m, dict) and isinstance(m.get("dir"), str)
             else p) / "tokenizer.json"
    tok = Tokenizer.from_file(str(p))
    found = find_eos(tok)
    eos = found[0] if found else EOS_TOKEN
    if found is None:
        ensure_eos(tok)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        bos_token=eos,
        pad_token=eos,
        unk_token=eos,
        clean_up_tokenization_spaces=False,
    )


def write_hf_tokenizer_files(path: str | os.PathLike[str], directory: str | os.PathLike[str],
                             model_max_length: int | None = None) -> list[str]:
    """Make ``directory`` an ``AutoTokenizer`` directory for the tokenizer at ``path``.

    Writes ``tokenizer.json`` (the file itself, byte for byte), ``tokenizer_config.json`` and
    ``special_tokens_map.json``: the end-of-text token is EOS, BOS, UNK and the padding token
    (it never occurs inside a document, and padded positions are masked), padding is on the
    left (batched generation), and ``model_max_length`` is the model's context.
    """
    from shutil import copyfile

    d = Path(directory)
    src = Path(path)
    if src.is_dir():
        src = src / "tokenizer.json"
    if src.resolve() != (d / "tokenizer.json").resolve():
        copyfile(src, d / "tokenizer.json")
    tok = Tokenizer.from_file(str(src))
    found = find_eos(tok)
    if found is None:  # the model was trained with an added EOS: write it into the file too
        ensure_eos(tok)
        atomic_write_text(d / "tokenizer.json", tok.to_str(pretty=True))
        found = find_eos(tok)
    eos, eos_id = found
    special = {"bos_token": eos, "eos_token": eos, "pad_token": eos, "unk_token": eos}
    cfg: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "padding_side": "left",
        # no token_type_ids: transformers 4.x's generate refuses an input the model does not take
        "model_input_names": ["input_ids", "attention_mask"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(eos_id): {"content": eos, "lstrip": False,
                                                "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True}},
    }
    if model_max_length:
        cfg["model_max_length"] = int(model_max_length)
    atomic_write_text(d / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")
    atomic_write_text(d / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
