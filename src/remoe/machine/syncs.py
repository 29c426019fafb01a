"""Count the host synchronisations of PyTorch code on any device (a CPU run stands in for CUDA).

On a GPU, every read of a device tensor's values by the host (``.item()``, ``float(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``) and every op whose output *shape* depends
on the data (``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``bincount``,
``repeat_interleave`` without ``output_size``) makes the host wait until the GPU has caught up.
:class:`SyncCounter` records both kinds while it is active, on whatever device the code runs:

* dispatched ops, through a :class:`~torch.utils._python_dispatch.TorchDispatchMode` (forward and
  autograd backward alike): :data:`SYNC_OPS`, plus ``index`` / ``index_put_`` with a boolean
  index (CUDA expands it with ``nonzero``) and ``histc`` without a range;
* Python-level escapes that a CPU run does not dispatch: ``Tensor.tolist``, ``Tensor.numpy``
  (``np.asarray(t)`` included) and ``Tensor.cpu`` (which, while counting, returns a copy as it
  would from a GPU).

*Host tensors* are not counted: values that already crossed to the host (the result of a
counted ``.cpu()``), tensors built from Python data (``torch.tensor([...])``), tensors marked
with :meth:`SyncCounter.mark_host` (e.g. AdamW's step counters, which live on the CPU on a GPU
run too), and every tensor computed only from host tensors. What a CPU run cannot show:
host->device copies (``.to("cuda")`` is a no-op on CPU; on CUDA a copy from pageable memory
waits too) and syncs inside a kernel (none on the CUDA code paths counted here).

Which branch runs is the caller's business: to count the CUDA path on a CPU machine, select it
(``model.expert_backend=grouped_mm``: :func:`remoe.model.dispatch.plan` then takes its device
branch, not the numpy shortcut of the CPU backends). Usage::

    with SyncCounter() as sc, sc.watch(model, "forward"):
        out = model(ids, labels=ids)   # phase "forward"
        out.loss.backward()            # phase "backward" (any autograd backward pass)
        float(out.loss)                # phase "step" (outside any phase)
    sc.count("forward"), sc.by_phase(), print(sc.report())
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

#: ops that read device values to the host or size their output from them (CUDA)
SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t), if t: ...
    aten.nonzero.default, aten.nonzero.out,  # also torch.where(c), argwhere
    aten.masked_select.default, aten.masked_select.out,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.unique_dim_consecutive.default,
    aten.bincount.default,  # sizes its output from max(input) on CUDA
    aten.equal.default,  # returns a Python bool
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_BOOL_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
               aten._index_put_impl_.default}
# tensors made from Python values: torch.tensor(...), and the 0-d tensor a Python scalar becomes
# in an op such as torch.where(c, x, 0.0)
_HOST_FACTORIES = {aten.lift_fresh.default, aten.lift_fresh_copy.default,
                   aten.scalar_tensor.default}


@dataclass(frozen=True)
class SyncEvent:
    #: "backward" inside an autograd backward pass, else the innermost SyncCounter.phase() /
    #: watched module's name, else "step"
    phase: str
    what: str  # "aten.nonzero.default", "Tensor.tolist", ...
    where: str  # innermost remoe frame (file:line function), else the innermost frame


_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


def _where() -> str:
    frames = [f for f in traceback.extract_stack()
              if not f.filename.startswith(_TORCH_DIR) and not f.filename.endswith("/remoe/machine/syncs.py")]
    for f in reversed(frames):
        if "/remoe/" in f.filename:
            return f"{f.filename.rsplit('/remoe/', 1)[-1]}:{f.lineno} {f.name}"
    f = frames[-1] if frames else traceback.extract_stack()[-1]
    return f"{f.filename}:{f.lineno} {f.name}"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _is_sync(func, args, kwargs) -> bool:
    if func in SYNC_OPS:
        return True
    if func in _REPEAT_INTERLEAVE:  # without output_size the output length is read back
        return kwargs.get("output_size") is None
    if func in _BOOL_INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in (indices or ()))
    if func is aten.histc.default:  # min == max: the range is read from the data
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return lo == hi
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        ins = _tensors((args, kwargs))
        host = bool(ins) and all(c.is_host(t) for t in ins)
        if not host and not c._quiet and _is_sync(func, args, kwargs):
            c._record(str(func))
        out = func(*args, **kwargs)
        if host or func in _HOST_FACTORIES:
            for t in _tensors(out):
                c._host[t] = True
        return out


class SyncCounter:
    """Context manager recording every host synchronisation (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self._phase = "step"
        self._quiet = False  # inside a counted Python-level escape: do not count its ops again
        self._host = WeakIdKeyDictionary()
        self._mode: _Mode | None = None
        self._saved: dict[str, object] = {}

    # -- public ---------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the syncs inside to ``name`` (nestable; the innermost wins)."""
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    @contextmanager
    def watch(self, module: torch.nn.Module, name: str = "forward") -> Iterator[None]:
        """Attribute the syncs of ``module``'s forward calls to phase ``name`` (hooks, removed
        on exit); its backward counts as "backward" like every backward pass."""
        stack: list[str] = []

        def pre(mod, args):
            stack.append(self._phase)
            self._phase = name

        def post(mod, args, out):
            self._phase = stack.pop()

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """Tensors that live on the host on a GPU run too: reading them is not a sync."""
        for t in tensors:
            self._host[t] = True

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def count(self, phase: str | None = None) -> int:
        return sum(1 for e in self.events if phase is None or e.phase == phase)

    def by_phase(self) -> dict[str, int]:
        return dict(Counter(e.phase for e in self.events))

    def report(self) -> str:
        """One line per distinct (phase, op, place) with its count: what a failing test prints."""
        if not self.events:
            return "no host synchronisation"
        rows = Counter((e.phase, e.what, e.where) for e in self.events)
        return "\n".join(f"{n:4d} x {p}: {w} at {loc}" for (p, w, loc), n in rows.most_common())

    # -- machinery ------------------------------------------------------------------------
    def _record(self, what: str) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self._phase
        self.events.append(SyncEvent(phase, what, _where()))

    def _escape(self, name: str, copy: bool = False):
        orig = getattr(torch.Tensor, name)
        counter = self

        def patched(t, *args, **kwargs):
            if counter._quiet or counter.is_host(t):
                return orig(t, *args, **kwargs)
            counter._record(f"Tensor.{name}")
            counter._quiet = True
            try:
                out = orig(t, *args, **kwargs)
                if copy and isinstance(out, torch.Tensor):
                    if out is t or out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                        out = out.clone()  # a GPU tensor's .cpu() is a new host tensor
                    counter._host[out] = True
            finally:
                counter._quiet = False
            return out

        patched.__name__ = name
        return orig, patched

    def __enter__(self) -> "SyncCounter":
        for name, copy in (("tolist", False), ("numpy", False), ("cpu", True)):
            self._saved[name], patched = self._escape(name, copy)
            setattr(torch.Tensor, name, patched)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            for name, orig in self._saved.items():
                setattr(torch.Tensor, name, orig)
            self._saved.clear()


__all__ = ["SyncCounter", "SyncEvent", "SYNC_OPS"]
