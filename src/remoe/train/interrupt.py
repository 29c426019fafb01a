"""Ctrl-C or a SIGTERM during training keeps the work: the first SIGINT or SIGTERM finishes the
current step and the trainer writes a checkpoint and stops (:class:`TrainingInterrupted`, exit
status 130 for SIGINT, 143 for SIGTERM -- what a job scheduler's pre-emption sends -- with the
command that resumes); a second signal stops at once (``KeyboardInterrupt`` for SIGINT, the
default termination for SIGTERM).

Only in a single process: under torchrun every rank would have to agree on the step to stop
at, so there a SIGINT stops at once and the run resumes from its last periodic checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path


class TrainingInterrupted(Exception):
    """The run stopped on a SIGINT or SIGTERM (``signum``) after ``step``, checkpointed in
    ``checkpoint``; :attr:`exit_status` is 128 + the signal's number (130, 143)."""

    def __init__(self, step: int, checkpoint: Path | None,
                 signum: int = signal.SIGINT) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint, self.signum = step, checkpoint, int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnInterrupt:
    """Context manager: while active, the first SIGINT or SIGTERM sets :attr:`requested` and
    :attr:`signum` (and puts the previous handlers back, so a second signal acts as it did
    before). A signal is left alone outside the main thread, when disabled, or when it is
    ignored (``nohup`` ignores SIGINT)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self.signum: int | None = None
        self._prev: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.requested, self.signum = True, signum
        self._restore()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
        print(f"\nremoe train: {what}: finishing this step, then a checkpoint ({again} to stop "
              "at once, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for sig, prev in self._prev.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, prev)
        self._prev = {}

    def __enter__(self) -> "StopOnInterrupt":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                prev = signal.getsignal(sig)
                if prev is not signal.SIG_IGN and prev is not None:
                    self._prev[sig] = prev
                    signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
