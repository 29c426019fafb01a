"""``train.dispatch_plan=capacity`` in the trainer (the GPU path, run on CPU: ``grouped_mm``).

Each step's MoE layers get a capacity from the previous steps' counts; a step whose pairs did
not fit is redone, so every step equals the exact plan's (the losses, the counts, the weights);
no host synchronisation in any MoE layer; compiled, one graph per block, no break, and after
the capacity has become symbolic nothing compiles again.
"""

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from remoe.lab.bench.syncs import SyntheticData, close_trainer, step_config
from remoe.machine.syncs import SyncCounter
from remoe.train import runtime
from remoe.train.control import CapacityPlan

_COMPILE_BLOCKS = runtime.compile_blocks


def _trainer(tmp_path, name, plan, extra=(), router="relu", grad_accum=2):
    from remoe.train.trainer import Trainer

    cfg = step_config(router, "micro", 32, 2, grad_accum, tmp_path / name,
                      [f"train.dispatch_plan={plan}", "train.num_threads=1",
                       "train.max_steps=40", "train.lr=3e-3", *extra])
    return Trainer(cfg, progress=False, data=SyntheticData())


def _steps(t, n):
    recs = []
    for _ in range(n):
        recs.append(t.train_step())
    return recs


def _same(a, b):
    keys = ("loss", "lm_loss", "reg_loss", "sparsity", "expert_counts", "grad_norm", "lambda")
    return all(a[k] == b[k] for k in keys)


def test_plan_capacities_follow_the_counts():
    p = CapacityPlan(2, headroom=1.1, window=3, align=8)
    assert p.capacities(100) == [CapacityPlan.FULL] * 2  # nothing seen yet
    p.record([30.0, 12.0], 100)
    p.record([40.0, 10.0], 100)
    assert p.capacities(100) == [48, 16]  # max 0.40 / 0.12 per token x 1.1, to 8 rows
    assert p.capacities(200) == [88, 32]
    for _ in range(3):
        p.record([20.0, 10.0], 100)  # the window forgets the 40
    assert p.capacities(100) == [24, 16]
    assert p.refit([50.0, 10.0], 100, 1) == [56, 16] and p.redone == 1
    assert p.refit([50.0, 10.0], 100, 2) == [CapacityPlan.FULL] * 2


@pytest.mark.parametrize("router,extra", [("relu", ()), ("relu", ("model.max_active=3",)),
                                          ("relu_threshold", ())])
def test_capacity_steps_equal_the_exact_plan_and_overflows_are_redone(tmp_path, router, extra):
    exact = _trainer(tmp_path, "exact", "exact", extra, router)
    cap = _trainer(tmp_path, "cap", "capacity", extra, router)
    try:
        forced = 0
        for i in range(12):
            if i in (4, 8):  # a too small capacity: the step must come out the same
                cap.capacity.history.clear()
                cap.capacity.record([1.0] * cap.capacity.num_layers, 1000)
                forced += 1
            a, b = exact.train_step(), cap.train_step()
            assert _same(a, b), (i, a["loss"], b["loss"])
            assert "plan_capacity" not in a and len(b["plan_capacity"]) == 2
        assert cap.capacity.redone >= forced
        for (n, p), (_, q) in zip(exact.model.named_parameters(), cap.model.named_parameters()):
            assert torch.equal(p, q), n
    finally:
        close_trainer(exact)
        close_trainer(cap)


def test_no_sync_in_any_moe_layer_and_one_per_step(tmp_path):
    t = _trainer(tmp_path, "cap", "capacity")
    try:
        _steps(t, 2)  # the first step runs at FULL, the second at the fitted capacity
        with SyncCounter() as sc, sc.watch(t.model, "forward"):
            sc.mark_host(*[st["step"] for st in t.optimizer.state.values()
                           if isinstance(st.get("step"), torch.Tensor)])
            rec = t.train_step()
        assert rec["plan_redone"] == 0
        assert sc.count("forward") == 0 and sc.count("backward") == 0, sc.report()
        assert sc.count() == 1, sc.report()  # the step's one copy to the host
    finally:
        close_trainer(t)


@pytest.fixture
def dynamo(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(runtime, "compile_blocks",
                        functools.partial(_COMPILE_BLOCKS, backend="eager"))
    yield
    torch._dynamo.reset()


def test_compiled_one_graph_per_block_and_no_recompile_after_warm_up(tmp_path, dynamo):
    extra = ("train.precision=bf16", "train.compile=true")
    t = _trainer(tmp_path, "cap", "capacity", extra, grad_accum=1)
    t.capacity = CapacityPlan(2, window=1, align=8)  # a capacity that moves every step
    try:
        graphs, caps = [], []
        for _ in range(14):
            rec = t.train_step()
            graphs.append(runtime.compile_counters()["frames"])
            caps.append(tuple(rec["plan_capacity"]))
        assert len(set(caps)) > 3  # the capacities moved
        assert runtime.compile_counters()["graph_breaks"] == 0, dict(counters["graph_break"])
        # FULL, then the first fitted value, then symbolic: at most 3 graphs, none after step 3
        assert 1 <= graphs[-1] <= 3 and graphs[-1] == graphs[3], graphs
    finally:
        close_trainer(t)
