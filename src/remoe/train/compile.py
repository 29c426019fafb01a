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
    a static capacity (no host sync), ``exact`` plans the active pairs only (``nonzero``); the
    number of MoE layers set."""
    from remoe.model.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.static_plan = plan == "static"
    return len(layers)


def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide counters: frames compiled (``frames``: one per compiled graph
    entry, recompilations included) and graph breaks (``graph_breaks``)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


__all__ = ["compile_blocks", "compile_counters", "set_dispatch_plan"]
