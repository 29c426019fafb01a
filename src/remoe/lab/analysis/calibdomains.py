"""The domain of each calibration sequence of a run's routing masks.

The mask files hold the calibration tokens (``token_ids``) but not their domains. The trainer
takes them from the validation split (:func:`remoe.train.metrics.calibration_set`), so each
calibration row of ``seq_len`` tokens is found, by its content, among the labelled validation
chunks of the run's data cache. A row found in no chunk (another cache, another tokenizer) or
in chunks of two domains is an error: the labels are exact or absent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from remoe.errors import ConfigError

_AMBIGUOUS = -1


def validation_index(bundle, seq_len: int, batch_size: int = 256) -> dict[bytes, int]:
    """First ``seq_len`` tokens (int64 bytes) of every validation chunk -> its domain id."""
    index: dict[bytes, int] = {}
    for batch in bundle.eval_batches("validation", seq_len=seq_len, batch_size=batch_size):
        ids = batch.input_ids[:, :seq_len].numpy().astype(np.int64)
        for row, dom in zip(ids, batch.domain_ids.numpy()):
            key = row.tobytes()
            prev = index.get(key)
            index[key] = int(dom) if prev in (None, int(dom)) else _AMBIGUOUS
    return index


def row_domains_R(token_ids_T: np.ndarray, seq_len: int, index: dict[bytes, int],
                  where: str = "calibration set") -> np.ndarray:
    """Domain id of each ``seq_len``-token row of ``token_ids_T`` (ConfigError if unknown)."""
    T = int(token_ids_T.size)
    if seq_len < 1 or T % seq_len:
        raise ConfigError(f"{where}: {T} tokens are not whole rows of seq_len={seq_len}")
    rows = np.asarray(token_ids_T, dtype=np.int64).reshape(T // seq_len, seq_len)
    out = np.empty(rows.shape[0], dtype=np.int64)
    for r, row in enumerate(rows):
        dom = index.get(row.tobytes())
        if dom is None:
            raise ConfigError(f"{where}: row {r} is not a validation chunk of the data cache "
                              "(a different cache or tokenizer; rebuild it with `remoe data` "
                              "and the run's data config)")
        if dom == _AMBIGUOUS:
            raise ConfigError(f"{where}: row {r} occurs in validation chunks of two domains")
        out[r] = dom
    return out


def open_cache(cache_dir: str | Path):
    """The prepared data cache (never rebuilt here), or a one-line ConfigError."""
    from remoe.data import load_prepared

    try:
        return load_prepared(cache_dir, verify=False)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(f"data cache {str(cache_dir)!r}: {e}") from None
