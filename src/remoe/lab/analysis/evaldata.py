"""Where the model-based analyses get their tokens from (``remoe analyze --data``).

* ``validation`` -- the run's validation split with domain labels, read from the prepared data
  cache named in the run's ``config.yaml`` (``data.cache_dir``, or ``--data-cache``) with
  :func:`remoe.data.load_prepared` (never rebuilt here). Every domain gets the same number of
  chunks: ceil(max_tokens / (domains x seq_len)) evenly spaced chunks per domain.
* ``calib`` -- the run's fixed calibration tokens (``token_ids`` of its routing mask files),
  one pseudo-domain ``calibration``.
* a path to an ``.npz`` file with ``input_ids`` int [B, S] and optionally ``domain_ids`` int [B]
  and ``domains`` (names): any tokens you want to analyse.
* ``auto`` (default) -- ``validation`` if the data cache opens, else ``calib`` (with a warning).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from remoe.lab.analysis.runlog import Run, load_masks
from remoe.errors import ConfigError


@dataclass
class EvalTokens:
    batches: Callable[[], Iterable]  # -> iterator of (input_ids [B, S'], domain_ids [B])
    domains: list[str]
    seq_len: int | None  # columns to feed (None: all)
    source: str  # a description for the outputs
    limit: int | None = None  # stop after this many tokens (None: the batches are bounded)


def _rows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    n = ids.size // seq_len
    return ids[: n * seq_len].reshape(n, seq_len) if n else ids.reshape(1, -1)


def _batched(input_ids: np.ndarray, domain_ids: np.ndarray, batch_size: int):
    for i in range(0, input_ids.shape[0], batch_size):
        yield (torch.from_numpy(np.ascontiguousarray(input_ids[i:i + batch_size], dtype=np.int64)),
               torch.from_numpy(np.ascontiguousarray(domain_ids[i:i + batch_size], dtype=np.int64)))


def calib_tokens(run: Run, batch_size: int, max_tokens: int | None) -> EvalTokens:
    files = run.mask_files()
    if not files:
        raise ConfigError(f"--data calib: {run.path}/routing holds no masks_<step>.npz")
    _, token_ids, _ = load_masks(files[-1][1])
    ids = _rows(token_ids.astype(np.int64), min(run.seq_len(), token_ids.size))
    return EvalTokens(lambda: _batched(ids, np.zeros(ids.shape[0], np.int64), batch_size),
                      ["calibration"], None, f"calibration set of {files[-1][1].name}",
                      max_tokens)


def npz_tokens(path: Path, batch_size: int, max_tokens: int | None) -> EvalTokens:
    with np.load(path, allow_pickle=False) as z:
        if "input_ids" not in z.files:
            raise ConfigError(f"--data {str(path)!r} has no 'input_ids' array")
        ids = np.asarray(z["input_ids"], dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        dom = (np.asarray(z["domain_ids"], dtype=np.int64).reshape(-1) if "domain_ids" in z.files
               else np.zeros(ids.shape[0], np.int64))
        names = ([str(x) for x in z["domains"]] if "domains" in z.files
                 else [f"domain{i}" for i in range(int(dom.max()) + 1 if dom.size else 1)])
    if dom.shape[0] != ids.shape[0]:
        raise ConfigError(f"--data {str(path)!r}: domain_ids has {dom.shape[0]} rows, input_ids "
                          f"{ids.shape[0]}")
    return EvalTokens(lambda: _batched(ids, dom, batch_size), names, None, f"tokens of {path}",
                      max_tokens)


def validation_tokens(run: Run, batch_size: int, max_tokens: int | None,
                      cache_dir: str | None) -> EvalTokens:
    from remoe.data import load_prepared

    cache = cache_dir or (run.config.get("data") or {}).get("cache_dir")
    if not cache:
        raise ConfigError(f"{run.path}/config.yaml names no data.cache_dir (use --data-cache)")
    try:
        bundle = load_prepared(cache, verify=False)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(f"--data validation: {e}") from None
    seq = run.seq_len()
    per_domain = (None if max_tokens is None
                  else max(1, math.ceil(max_tokens / (len(bundle.domains) * seq))))
    return EvalTokens(
        lambda: ((b.input_ids, b.domain_ids) for b in bundle.eval_batches(
            "validation", seq_len=seq, batch_size=batch_size, max_chunks_per_domain=per_domain)),
        list(bundle.domains), seq,
        f"validation split of {cache}, {per_domain or 'all'} chunks of {seq} tokens per domain")


def eval_tokens(run: Run, data: str = "auto", *, batch_size: int = 8,
                max_tokens: int | None = None, cache_dir: str | None = None) -> EvalTokens:
    """The :class:`EvalTokens` named by ``data`` (see the module docstring)."""
    if data == "calib":
        return calib_tokens(run, batch_size, max_tokens)
    if data == "validation":
        return validation_tokens(run, batch_size, max_tokens, cache_dir)
    if data == "auto":
        try:
            return validation_tokens(run, batch_size, max_tokens, cache_dir)
        except (ConfigError, ImportError) as e:
            print(f"remoe analyze: warning: no validation data ({e}); using the calibration "
                  "tokens of the routing masks (no domain labels)", file=sys.stderr)
            return calib_tokens(run, batch_size, max_tokens)
    p = Path(data)
    if p.suffix == ".npz" and p.is_file():
        return npz_tokens(p, batch_size, max_tokens)
    raise ConfigError(f"--data={data!r} must be auto, validation, calib or an existing .npz file")
