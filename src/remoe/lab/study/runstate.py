"""What ``study.json`` records of one run: state, attempts, wall times (:class:`RunState`),
and how time is accounted, including an attempt that died together with its study."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunState:
    state: str = "pending"  # pending | running | done | failed | skipped | interrupted
    exit_status: int | None = None
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    wall_s: float | None = None  # of the last attempt (the whole child process)
    total_wall_s: float = 0.0  # over every attempt
    resumed: bool = False
    message: str | None = None
    phase: str = "train"  # train | eval (the zero-shot evaluation of a trained run)
    eval_wall_s: float = 0.0  # of the zero-shot evaluations, over every attempt

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def add_wall(st: RunState, seconds: float) -> None:
    """Training time goes to ``wall_s``/``total_wall_s``, evaluation to ``eval_wall_s``."""
    if st.phase == "eval":
        st.eval_wall_s = (st.eval_wall_s or 0.0) + seconds
    else:
        st.wall_s = seconds
        st.total_wall_s = (st.total_wall_s or 0.0) + seconds


def last_write(paths: list[Path]) -> float | None:
    """The latest modification time among ``paths`` that exist (None: none does)."""
    return max((p.stat().st_mtime for p in paths if p.is_file()), default=None)
