"""Reading a converter's source directory and writing its destination.

A source is either a remoe model directory (``config.json`` with ``model_type: remoe``) or a
transformers one (``llama``, ``mixtral``, ...); both are loaded on the CPU in fp32 so that the
copied weights are exact. The destination gets the tokenizer files of the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from remoe.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def model_type(src: str | Path) -> str:
    """``model_type`` of a model directory's ``config.json``."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise ConfigError(f"SRC={str(src)!r} must be a model directory with a config.json")
    return str(json.loads(path.read_text(encoding="utf-8")).get("model_type", ""))


def load_remoe(src: str | Path):
    from remoe import ReMoEForCausalLM
    from remoe.rundir.bars import no_hf_bars

    with no_hf_bars():
        return ReMoEForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def load_hf(src: str | Path, expected: tuple[str, ...]):
    """A transformers causal LM whose ``model_type`` is one of ``expected``."""
    kind = model_type(src)
    if kind not in expected:
        raise ConfigError(f"SRC model_type={kind!r} must be one of {', '.join(expected)}")
    from transformers import AutoModelForCausalLM

    from remoe.rundir.bars import no_hf_bars

    with no_hf_bars():
        return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def load_hf_config(src: str | Path, expected: tuple[str, ...]):
    """The transformers config of a model directory whose ``model_type`` is one of
    ``expected`` (no weights read)."""
    kind = model_type(src)
    if kind not in expected:
        raise ConfigError(f"SRC model_type={kind!r} must be one of {', '.join(expected)}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src)


def check_destination(dst: str | Path, force: bool) -> Path:
    d = Path(dst)
    if d.exists() and any(d.iterdir()) and not force:
        raise ConfigError(f"DST={str(d)!r} must not exist or be empty (or pass --force)")
    return d


def save(model: Any, src: str | Path, dst: str | Path, command: str = "remoe convert",
         what: str = "") -> Path:
    """``save_pretrained`` (safetensors), then the source's tokenizer files; a ReMoE gets a
    model card naming its source, the conversion ``command`` and ``what`` it does, and the
    source's licence (from its README.md)."""
    d = Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    from remoe.rundir.bars import no_hf_bars

    with no_hf_bars():
        model.save_pretrained(d, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file() and not (d / name).exists():
            shutil.copyfile(Path(src) / name, d / name)
    if getattr(model.config, "model_type", None) == "remoe":
        from remoe.model.bundle import CHECKSUMS_FILE, write_checksums
        from remoe.rundir.card import source_licence, write_card

        write_card(d, model, source={"path": str(src), "model_type": model_type(src),
                                     "command": command, "what": what, **source_licence(src)})
        if (d / CHECKSUMS_FILE).is_file():
            write_checksums(d)
    return d
