"""RNG states of a training process, checkpointed so that ``--resume`` continues bit-exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def to_weights_only(obj: Any) -> Any:
    """Make python/numpy RNG states loadable with ``torch.load(weights_only=True)``."""
    if isinstance(obj, tuple):
        return [to_weights_only(o) for o in obj]
    if isinstance(obj, list):
        return [to_weights_only(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_weights_only(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), int(np_state[2]),
                         int(np_state[3]), float(np_state[4])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
