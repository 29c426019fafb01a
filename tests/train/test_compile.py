"""``train.compile=true``: decoder blocks compiled one by one, ReLU routing without recompiles.

The device path (``grouped_mm``, bf16 autocast: dynamo's fake ``grouped_mm`` takes bf16 only)
on CPU with synthetic batches, so the routing changes from step to step. On the static
dispatch plan every shape is a function of the micro-batch: one graph per block, nothing
compiled again after the first step; on the default exact plan the graph breaks at the plan's
``nonzero`` and, after a warm-up, nothing is compiled again either. Dynamo runs under the ``eager`` backend (its graphs executed op by op: the
same numerics as eager mode, losses to 1e-5) and under ``aot_eager`` (AOTAutograd traces the
joint forward/backward graph, including the plan; its decompositions round bf16 differently).
Inductor's code generation is left to the GPU check: on CPU it takes minutes.
"""

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from remoe.lab.bench.syncs import SyntheticData, close_trainer, step_config
from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.train import runtime

_COMPILE_BLOCKS = runtime.compile_blocks


def _train(tmp_path, router, compiled, steps, backend="eager", extra=()):
    from remoe.train.trainer import Trainer

    cfg = step_config(router, "micro", 32, 2, 1, tmp_path / f"{router}-{compiled}",
                      ["train.precision=bf16", f"train.compile={str(compiled).lower()}",
                       "train.num_threads=1", f"train.max_steps={steps + 5}", *extra])
    t = Trainer(cfg, progress=False, data=SyntheticData())
    losses, sparsity, graphs = [], [], []
    try:
        if compiled:
            assert all(b._compiled_call_impl is not None for b in t.model.layers)
        for _ in range(steps):
            rec = t.train_step()
            losses.append(rec["loss"])
            sparsity.append(rec["sparsity"])
            graphs.append(runtime.compile_counters()["frames"])
        keys = sorted(t.model.state_dict())
    finally:
        close_trainer(t)
    return losses, sparsity, graphs, keys


@pytest.fixture
def dynamo(monkeypatch):
    """A clean dynamo state; ``dynamo(backend)`` makes the trainer compile with ``backend``."""
    torch._dynamo.reset()
    counters.clear()

    def use(backend):
        monkeypatch.setattr(runtime, "compile_blocks",
                            functools.partial(_COMPILE_BLOCKS, backend=backend))

    yield use
    torch._dynamo.reset()


def test_relu_twenty_steps_compiled_equal_eager_without_recompiles(tmp_path, dynamo):
    static = ["train.dispatch_plan=static"]
    dynamo("eager")
    eager, sparsity, _, keys_eager = _train(tmp_path, "relu", False, 20, extra=static)
    compiled, sparsity_c, graphs, keys = _train(tmp_path, "relu", True, 20, extra=static)
    assert len(set(sparsity)) > 5  # the routing (pairs per step) changes from step to step
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-5 * abs(a), (eager, compiled)
    warm = 2
    recompiles = graphs[-1] - graphs[warm - 1]
    assert graphs[0] >= 1 and recompiles == 0, graphs
    assert runtime.compile_counters()["graph_breaks"] == 0, dict(counters["graph_break"])
    assert keys == keys_eager  # compiled in place: the same parameter names


def test_relu_on_the_exact_plan_compiles_with_bounded_graphs(tmp_path, dynamo):
    """The default plan (``nonzero``: a data-dependent size) breaks each block's graph at the
    plan; the pair count changes every step, yet after the warm-up nothing compiles again."""
    dynamo("eager")
    eager, sparsity, _, _ = _train(tmp_path, "relu", False, 12)
    compiled, _, graphs, _ = _train(tmp_path, "relu", True, 12)
    assert len(set(sparsity)) > 3
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-5 * abs(a), (eager, compiled)
    assert graphs[0] >= 1 and graphs[-1] == graphs[3], graphs


def test_dispatch_plan_auto_is_resolved_per_device_and_checked(tmp_path):
    from remoe.model.moe import MoELayer

    tc = load_config(None, []).train
    assert tc.dispatch_plan == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert runtime.resolve_dispatch_plan(tc, cpu) == "exact"  # the CPU default: as it was
    assert runtime.resolve_dispatch_plan(tc, cuda) == "exact"  # eager: not measured faster
    on = load_config(None, ["train.compile=true"]).train
    assert runtime.resolve_dispatch_plan(on, cuda) == "capacity"  # 1.22x on an H200
    assert runtime.resolve_dispatch_plan(on, cpu) == "exact"
    assert runtime.resolve_dispatch_plan(on, cuda, world_size=2) == "exact"  # not measured
    for other in ("train.expert_parallel=true", "train.fsdp=true"):
        assert runtime.resolve_dispatch_plan(
            load_config(None, ["train.compile=true", other]).train, cuda) == "exact"
    for plan in ("exact", "static", "capacity"):  # an explicit plan is the plan
        assert runtime.resolve_dispatch_plan(
            load_config(None, [f"train.dispatch_plan={plan}"]).train, cpu) == plan
    with pytest.raises(ConfigError, match="train.dispatch_plan"):
        load_config(None, ["train.dispatch_plan=padded"])
    cfg = load_config(None, ["model.router=relu", "model.preset=micro"])
    from remoe.model import ReMoEForCausalLM

    model = ReMoEForCausalLM(cfg.model_config(vocab_size=64))
    assert runtime.set_dispatch_plan(model, "static") == len(model.layers)
    assert all(m.static_plan for m in model.modules() if isinstance(m, MoELayer))
    runtime.set_dispatch_plan(model, "exact")
    assert not any(m.static_plan for m in model.modules() if isinstance(m, MoELayer))


@pytest.mark.parametrize("router", ["relu", "topk"])
def test_aot_autograd_traces_the_block_with_its_plan(tmp_path, dynamo, router):
    dynamo("aot_eager")
    static = ["train.dispatch_plan=static"]  # one graph per block: the plan traced with it
    eager, _, _, _ = _train(tmp_path, router, False, 4, extra=static)
    compiled, _, graphs, _ = _train(tmp_path, router, True, 4, extra=static)
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 2e-3 * abs(a), (eager, compiled)  # bf16 rounding, decomposed
    assert graphs[-1] == graphs[0] >= 1, graphs
    assert runtime.compile_counters()["graph_breaks"] == 0, dict(counters["graph_break"])


def test_compile_is_off_by_default_and_a_bool():
    assert load_config(None, []).train.compile is False
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=maybe"])
