"""``train.compile=true``: each decoder block compiled on its own, in place.

As torchtitan does for its transformer blocks: the blocks share one code object, so dynamo
traces a block once and every block of the model runs the same compiled graphs (the parameters
are graph inputs); the embedding, the final norm, the LM head and the loss stay eager. Applied
after expert parallelism and before FSDP. ``nn.Module.compile`` compiles in place, so the
parameter names, the state dict and the checkpoints are those of the eager model.

Shapes: a block's tensors are sized by the tokens of a micro-batch (fixed in training) and, for
data-dependent routing (ReLU), by the dispatch plan (``train.dispatch_plan``). On the default
exact plan the pair count comes from a ``nonzero``: dynamo breaks the block's graph there and
compiles the pieces around it once, with the pair count symbolic, so a change of routing does
not recompile (tests/train/test_compile.py). On the static plan the plan is padded to ``T*N``
rows (:func:`remoe.model.dispatch.plan`): one graph per block, no break, no sync -- but slower
on an H200 (docs/SCALING.md). What does recompile: a new micro-batch shape (evaluation batches;
automatic dynamic shapes then make that dimension symbolic), and grad mode on / off. The fused
CPU backend (a custom kernel walking a host-side plan) is not traceable; dynamo runs it eagerly
between graphs, so on CPU ``model.expert_backend=grouped_mm`` is the compileable path.
"""

from __future__ import annotations

import math
from collections import deque

from torch import nn


def compile_blocks(model: nn.Module, **options) -> int:
    """Compile every block of ``model.layers`` in place (``torch.compile`` ``options``, e.g.
    ``backend=``); the number of blocks compiled."""
    blocks = list(getattr(model, "layers", ()))
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def set_dispatch_plan(model: nn.Module, plan: str) -> int:
    """``train.dispatch_plan``: ``static`` pads every MoE layer's data-dependent dispatch plan to
    a static capacity (no host sync), ``exact`` plans the active pairs only (``nonzero``), and
    ``capacity`` leaves the layers exact: the trainer passes each forward its capacities
    (:class:`CapacityPlan`); the number of MoE layers set."""
    from remoe.model.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.static_plan = plan == "static"
    return len(layers)


class CapacityPlan:
    """``train.dispatch_plan=capacity``: the pair capacity of each MoE layer's on-device dispatch
    plan, for the next step, from the counts the step's one copy to the host already brings.

    A layer's capacity is the most pairs per token that one of its micro-batches held over the
    last ``window`` steps, times ``headroom``, times the tokens of a micro-batch, rounded up to a
    multiple of ``align`` rows. Before any step has been seen (the first step, a resume) it is
    :data:`FULL`: the layer's own bound (``T * N``, or ``T * max_active``). A step whose pairs
    did not fit is redone (the trainer) with :meth:`refit`: the pairs each layer needed, and if
    that does not fit either, :data:`FULL`. So no pair is ever dropped and every step's result
    is the exact plan's. Holds no state a checkpoint needs (a resumed run starts at FULL).
    """

    #: a capacity no layer reaches: the layer's own bound applies (MoELayer takes the minimum)
    FULL = 1 << 62

    def __init__(self, num_layers: int, headroom: float = 1.1, window: int = 16,
                 align: int = 64) -> None:
        self.num_layers, self.headroom, self.align = num_layers, headroom, align
        self.history: deque[list[float]] = deque(maxlen=window)  # pairs per token, per layer
        self.redone = 0  # steps redone after an overflow, over the run

    def _fit(self, per_token_L: list[float], tokens: int) -> list[int]:
        a = self.align
        return [max(a, math.ceil(p * tokens * self.headroom / a) * a) for p in per_token_L]

    def capacities(self, tokens: int) -> list[int]:
        """Each MoE layer's capacity for a step of ``tokens`` tokens per micro-batch."""
        if not self.history:
            return [self.FULL] * self.num_layers
        return self._fit([max(col) for col in zip(*self.history)], tokens)

    def record(self, pairs_max_L: list[float], tokens: int) -> None:
        """A finished step: each layer's most pairs in one micro-batch of ``tokens`` tokens."""
        self.history.append([p / tokens for p in pairs_max_L])

    def refit(self, pairs_max_L: list[float], tokens: int, attempt: int) -> list[int]:
        """The capacities to redo a step whose plan was cut (``attempt`` 1, 2, ...): the pairs
        the cut step counted (its counts are exact), then :data:`FULL`."""
        self.redone += 1
        if attempt > 1:
            return [self.FULL] * self.num_layers
        return self._fit([p / tokens for p in pairs_max_L], tokens)


def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide counters: frames compiled (``frames``: one per compiled graph
    entry, recompilations included) and graph breaks (``graph_breaks``)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


__all__ = ["CapacityPlan", "compile_blocks", "compile_counters", "set_dispatch_plan"]
