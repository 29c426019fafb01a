"""lm-eval adapter: ``RemoeLM``, registered with lm-eval as model ``"remoe"``.

``RemoeLM`` is lm-eval's ``HFLM`` (its batching, padding, ``loglikelihood``,
``loglikelihood_rolling`` and ``generate_until``) around a :class:`remoe.ReMoEForCausalLM`
loaded with :func:`remoe.rundir.loading.load_model` -- a run directory (its ``final/``, else
the LATEST checkpoint), a checkpoint directory or an HF directory -- and our ``tokenizer.json``
wrapped as a ``transformers.PreTrainedTokenizerFast`` (EOS = BOS = pad = ``<|endoftext|>``,
which is also the prefix token of an empty context). Nothing is downloaded: the adapter puts
the Hugging Face libraries in offline mode before anything else.

From Python::

    import lm_eval
    from remoe.eval.adapter import RemoeLM          # registers "remoe"
    lm_eval.simple_evaluate(model="remoe", model_args="pretrained=runs/tiny", tasks=[...])
    lm_eval.simple_evaluate(model=RemoeLM(pretrained=model_obj, tokenizer=tok), tasks=[...])

From the shell (lm-eval's own CLI cannot import our package by itself, so
:mod:`remoe.eval.harness` imports it first and then runs lm-eval's CLI unchanged)::

    python -m remoe.eval.harness --model remoe --model_args pretrained=runs/tiny --tasks ...
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from remoe.eval.offline import force_offline

force_offline()

import torch  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from transformers import PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from remoe.errors import ConfigError  # noqa: E402

log = logging.getLogger("remoe.eval")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Our ``tokenizer.json`` (file or directory) as a ``PreTrainedTokenizerFast``."""
    from remoe.data.tokenizer import load_hf_tokenizer

    p = Path(path)
    if not (p / "tokenizer.json" if p.is_dir() else p).is_file():
        raise ConfigError(f"tokenizer={str(p)!r}: no tokenizer.json there")
    return load_hf_tokenizer(p)


def _resolve_device(device: str | None) -> str:
    """``auto``/None: CUDA if present, else CPU. lm-eval's CLI passes ``cuda`` by default:
    without CUDA that falls back to the CPU (with a warning) instead of failing."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s requested but CUDA is not available: using the CPU", device)
        return "cpu"
    return str(device)


@register_model("remoe")
class RemoeLM(HFLM):
    """An lm-eval LM for remoe checkpoints.

    ``pretrained``: a run / checkpoint / HF directory, or a ``ReMoEForCausalLM`` instance.
    ``tokenizer``: a ``tokenizer.json`` path or directory, or a tokenizer object; default: the
    ``tokenizer.json`` found next to the checkpoint by ``load_model``.
    ``dtype``: ``float32`` (default), ``bfloat16`` or ``float16`` weights.
    Other keyword arguments (``batch_size``, ``max_length``, ``logits_cache``, ...) are
    ``HFLM``'s; ``max_length`` defaults to the model's ``max_position_embeddings``.
    """

    def __init__(self, pretrained: Any, tokenizer: Any = None, device: str | None = None,
                 dtype: Any = None, batch_size: int | str = 1, **kwargs: Any) -> None:
        force_offline()
        tok_path = None
        if isinstance(pretrained, (str, os.PathLike)):
            from remoe.rundir.loading import load_model

            model, tok_path = load_model(pretrained, device=_resolve_device(device))
            name = str(pretrained)
        elif isinstance(pretrained, PreTrainedModel):
            model = pretrained
            name = getattr(model, "name_or_path", "") or type(model).__name__
            if device not in (None, "", "auto"):
                model = model.to(_resolve_device(device))
        else:
            raise ConfigError(f"pretrained={pretrained!r} must be a directory or a model")
        if dtype not in (None, "", "auto"):
            if isinstance(dtype, str):
                if dtype not in _DTYPES:
                    raise ConfigError(f"dtype={dtype!r} must be one of {', '.join(_DTYPES)}")
                dtype = _DTYPES[dtype]
            model = model.to(dtype)
        if tokenizer is None:
            if tok_path is None:
                raise ConfigError(f"pretrained={name!r}: no tokenizer.json next to the checkpoint; "
                                  "pass tokenizer=PATH")
            tokenizer = tok_path
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = load_tokenizer(tokenizer)
        if isinstance(batch_size, str) and batch_size.isdigit():
            batch_size = int(batch_size)
        # HFLM warns at length about pre-built models (meant for multi-GPU launches we don't do)
        hf_log = logging.getLogger("lm_eval.models.huggingface")
        level = hf_log.level
        hf_log.setLevel(logging.ERROR)
        try:
            super().__init__(pretrained=model.eval(), tokenizer=tokenizer, backend="causal",
                             batch_size=batch_size, **kwargs)
        finally:
            hf_log.setLevel(level)
        self.model_name = name

    @property
    def tokenizer_name(self) -> str:
        return "remoe"

    def get_model_info(self) -> dict:
        return {"model_name": self.model_name, "model_num_parameters": self.model.num_parameters(),
                "model_active_parameters": self.model.num_parameters(active=True),
                "model_dtype": str(self.model.dtype)}
