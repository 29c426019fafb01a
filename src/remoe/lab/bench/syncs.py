"""Host synchronisations per training step, counted on the CUDA code path on any machine.

:func:`count_step_syncs` builds a real :class:`remoe.train.trainer.Trainer` (synthetic token
batches, a throw-away run directory) with ``model.expert_backend=grouped_mm`` -- the backend
CUDA uses, whose dispatch plan stays on the device -- runs one warm-up step, then counts one
optimizer step with :class:`remoe.machine.syncs.SyncCounter`:

* ``forward``: inside the model's forward (every micro-batch), ``per_layer_forward`` that
  divided by MoE layers and micro-batches;
* ``backward``: inside autograd's backward;
* ``step``: everything else of the step -- the one reduction of the step's sums, gradient
  clipping, the optimizer, the statistics and the lambda update.

AdamW's per-parameter step counters are host tensors on a GPU run too (``foreach`` without
``capturable``), so reading them is not counted. The targets (held by
``tests/model/test_syncs.py``): every router 0 in forward and backward (data-dependent ones,
ReLU, on the padded plan of static capacity, :func:`remoe.model.dispatch.plan`); at most one in
``step``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from remoe.machine.syncs import SyncCounter

ROUTERS = ("dense", "topk", "relu")


class _Batches:
    """``batch(step, micro, rank)`` -> ``(input_ids [B, S], domain_ids [B])``: seeded noise.
    ``pool``: every step reads the same ``pool`` micro-batches (micro-batch ``micro % pool`` of
    step 0), so that a router calibrated on them holds its density in every timed step."""

    def __init__(self, vocab: int, seq_len: int, micro_batch: int, seed: int,
                 pool: int | None = None) -> None:
        self.vocab, self.seq_len, self.micro_batch, self.seed = vocab, seq_len, micro_batch, seed
        self.pool = pool

    def batch(self, step: int, micro: int = 0, rank: int = 0):
        if self.pool is not None:
            step, micro = 0, micro % self.pool
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro * 31 + rank)
        ids = torch.randint(0, self.vocab, (self.micro_batch, self.seq_len), generator=g)
        return ids, torch.zeros(self.micro_batch, dtype=torch.int64)


class SyntheticData:
    """The part of :class:`remoe.data.DataBundle` that a training step reads."""

    def __init__(self, vocab_size: int = 384, pool: int | None = None) -> None:
        self.vocab_size, self.eos_id = vocab_size, 0
        self.pool = pool  # the same `pool` micro-batches every step (see _Batches)
        self.domains = ["synthetic"]
        self.tokenizer_path = None

    def train_batches(self, seq_len: int, micro_batch: int, grad_accum: int = 1,
                      world_size: int = 1, seed: int = 0, **_) -> _Batches:
        return _Batches(self.vocab_size, seq_len, micro_batch, seed, self.pool)

    def eval_batches(self, *args, **kwargs):
        return iter(())


def step_config(router: str, preset: str = "micro", seq_len: int = 32, micro_batch: int = 2,
                grad_accum: int = 2, out_dir: str | Path = ".", extra: list[str] | None = None):
    """The experiment config of the counted step (one process, grouped_mm, nothing periodic)."""
    from remoe.experiment import load_config

    sets = {"model.preset": preset, "model.router": router, "model.expert_backend": "grouped_mm",
            "train.seq_len": seq_len, "train.micro_batch_size": micro_batch,
            "train.grad_accum": grad_accum, "train.max_steps": 10, "train.warmup_steps": 1,
            "train.eval_every": 0, "train.save_every": 0, "train.log_every": 0,
            "analysis.record_masks_every": 0, "train.num_threads": torch.get_num_threads(),
            "run.out_dir": str(out_dir), "run.name": router}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()] + list(extra or []))


def count_step_syncs(router: str, preset: str = "micro", seq_len: int = 32, micro_batch: int = 2,
                     grad_accum: int = 2, extra: list[str] | None = None) -> dict:
    """Count one training step (after a warm-up step) of ``router``; see the module docstring."""
    from remoe.model.moe import MoELayer
    from remoe.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="remoe-syncs-") as tmp:
        cfg = step_config(router, preset, seq_len, micro_batch, grad_accum, tmp, extra)
        t = Trainer(cfg, progress=False, data=SyntheticData())
        for block in t.model.layers:  # the CUDA path's plan (CPU eager would plan exactly)
            if isinstance(block.ffn, MoELayer):
                block.ffn.static_plan = True
        try:
            t.train_step()  # warm-up: optimizer state, lazily built buffers
            with SyncCounter() as sc, sc.watch(t.model, "forward"):
                sc.mark_host(*[st["step"] for st in t.optimizer.state.values()
                               if isinstance(st.get("step"), torch.Tensor)])
                t.train_step()
        finally:
            close_trainer(t)
    layers = sum(isinstance(b.ffn, MoELayer) for b in t.model.layers)
    by = sc.by_phase()
    res = {"router": router, "preset": preset, "backend": "grouped_mm",
           "moe_layers": layers, "micro_batches": grad_accum,
           "forward": by.get("forward", 0), "backward": by.get("backward", 0),
           "step": by.get("step", 0), "total": sc.count(),
           "report": sc.report().splitlines()}
    res["per_layer_forward"] = (res["forward"] / (layers * grad_accum)) if layers else 0.0
    return res


def close_trainer(t) -> None:
    """Release a Trainer that never finished: its metrics files and its run-directory lock."""
    for f in (getattr(t, "metrics", None), getattr(t, "evals", None)):
        if f is not None:
            f.close()
    t.close()


def count_all(routers=ROUTERS, **kw) -> list[dict]:
    return [count_step_syncs(r, **kw) for r in routers]


__all__ = ["SyntheticData", "count_step_syncs", "count_all", "step_config", "close_trainer"]
