"""Ctrl-C during training keeps the work: the first SIGINT finishes the current step and the
trainer writes a checkpoint and stops (:class:`TrainingInterrupted`, exit status 130, with the
command that resumes); a second SIGINT stops at once (``KeyboardInterrupt``, as before).

Only in a single process: under torchrun every rank would have to agree on the step to stop
at, so there a SIGINT stops at once and the run resumes from its last periodic checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path


class TrainingInterrupted(Exception):
    """The run stopped on a SIGINT after ``step``, checkpointed in ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint = step, checkpoint


class StopOnInterrupt:
    """Context manager: while active, the first SIGINT sets :attr:`requested` (and puts the
    previous handler back, so a second one raises ``KeyboardInterrupt``). Inactive outside the
    main thread, when disabled, or when SIGINT is ignored (``nohup``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self._prev = None

    def _handler(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._prev)
        print("\nremoe train: Ctrl-C: finishing this step, then a checkpoint (press Ctrl-C again "
              "to stop at once, losing the steps since the last checkpoint)", file=sys.stderr,
              flush=True)

    def __enter__(self) -> "StopOnInterrupt":
        if self.enabled and threading.current_thread() is threading.main_thread():
            prev = signal.getsignal(signal.SIGINT)
            if prev is not signal.SIG_IGN and prev is not None:
                self._prev = prev
                signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            if signal.getsignal(signal.SIGINT) == self._handler:
                signal.signal(signal.SIGINT, self._prev)
            self._prev = None
