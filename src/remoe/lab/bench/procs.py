"""Fresh measuring processes for ``remoe bench``, cheap enough to start one per measurement.

Every measurement runs in a new process (clean heap, the chosen allocator, this process's thread
count), so that no allocator state carries from one row to the next. Spawning a Python process
that imports torch and transformers takes 10-40 s on a loaded 2-core machine; the robust method
(rows x rounds, each in its own process) would spend most of its time importing. So the
processes are *forked* from a server process (``multiprocessing``'s ``forkserver``) that imported
torch, transformers' Mixtral block and the bench modules once and never ran a torch operation
(no OpenMP pool exists to be broken by the fork). Each child still starts with the server's
small import-time heap and nothing else. The server is started with the allocator's environment
(``LD_PRELOAD`` for tcmalloc) and stopped when the :class:`FreshProcesses` block ends, so two
runs with different allocators never share it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.forkserver
import os
import sys

import torch

from remoe.machine import allocator

PRELOAD = ["torch", "remoe.lab.bench.common", "remoe.lab.bench.layer", "remoe.lab.bench.model",
           "transformers.models.mixtral.modeling_mixtral"]


def _child_call(mode: str, threads: int, modules: str, fn, args, kwargs):
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they happen
    from remoe.model import registry

    registry.import_modules([m for m in modules.split(",") if m], "--router-module")
    allocator.configure(mode, "remoe bench", may_reexec=False)  # the server preloaded tcmalloc
    torch.set_num_threads(threads)
    return fn(*args, **kwargs)


def _stop_server() -> None:
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)
    if stop is not None:  # CPython's forkserver: restarted on next use with the then environment
        stop()


class FreshProcesses:
    """``with FreshProcesses(mode, modules) as run: run(fn, *args, **kwargs)``: the call in a
    fresh process that uses allocator ``mode`` and this process's thread count; returns its
    result. ``modules``: router modules (``--router-module``) each child imports first."""

    def __init__(self, mode: str, modules: list[str] = ()) -> None:
        self.mode, self.modules = mode, ",".join(modules)
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "FreshProcesses":
        env = allocator.child_environment(self.mode)
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the server inherits it (tcmalloc must be preloaded at start)
        _stop_server()  # a server left by an earlier run may have another environment
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        return self

    def __call__(self, fn, *fargs, **fkwargs):
        sys.stdout.flush()
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=self.ctx) as pool:
            return pool.submit(_child_call, self.mode, torch.get_num_threads(), self.modules, fn,
                               fargs, fkwargs).result()

    def __exit__(self, *exc) -> None:
        _stop_server()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
