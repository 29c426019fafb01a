"""Host synchronisations on the CUDA code path, counted on CPU.

The targets, on the ``grouped_mm`` backend (the CUDA one, whose dispatch plan stays on the
device): every router none in the MoE layer's forward and backward (fixed-k routers on an exact
plan, data-dependent ones -- ReLU, BlockFFN -- on a plan padded to a static capacity); the rest
of an optimizer step (the step's sums, gradient norm, statistics, lambda update) at most one;
expert parallelism adds only the all-to-all's split sizes (one per layer, forward only) and
plans exactly (data-dependent routing: one more).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from remoe.model import registry
from remoe.model import dispatch
from remoe.model.moe import MoEConfig, MoELayer
from remoe.machine.syncs import SyncCounter

FIXED_K = ("topk", "topk_warmup", "topk_auxfree", "sparsemixer", "hash", "expert_choice")
DATA_DEPENDENT = ("relu", "blockffn", "relu_threshold", "expert_threshold")


def test_every_token_router_is_classified():
    tokens = {n for n in registry.names() if registry.is_token_router(n)}
    assert tokens == set(FIXED_K) | set(DATA_DEPENDENT)  # a new router must pick its target


# ----------------------------------------------------------------------------- the counter

def test_counter_counts_ops_and_python_escapes_but_not_host_tensors():
    x = torch.randn(8, 4, requires_grad=True)
    with SyncCounter() as sc:
        y = x * 2
        m = y > 0
        d = y.detach()
        d.sum().item(), float(d.sum()), bool(d.sum() > 0)  # 3 x _local_scalar_dense
        m.nonzero(), torch.where(m), y[m]  # nonzero x 2, boolean index
        y.tolist(), np.asarray(y.detach())  # Python-level escapes
        h = y.detach().cpu()  # counted; h is a host copy from here on
        assert h.data_ptr() != y.data_ptr()
        h.tolist(), h.sum().item(), h.numpy()  # host: not counted
        t = torch.tensor([1.0, 2.0])  # built from Python data: host
        t.tolist(), float(t[0])
        torch.repeat_interleave(y.detach().abs().long(), 2)  # a repeat count, not a tensor
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]).to(torch.int64) + m.sum() * 0)
        torch.repeat_interleave(torch.arange(3), torch.ones(3, dtype=torch.long), output_size=3)
        m.t().nonzero_static(size=5), torch.bincount(m.flatten().long(), minlength=2)
        y[m].sum().backward()  # the backward's boolean index_put
    by_what = {}
    for e in sc.events:
        by_what.setdefault(e.what, []).append(e.phase)
    assert len(by_what.pop("aten._local_scalar_dense.default")) == 3
    assert len(by_what.pop("aten.nonzero.default")) == 2
    assert by_what.pop("aten.index.Tensor") == ["step", "step"]  # y[m] twice, both forward
    assert by_what.pop("aten.index_put.default") == ["backward"]
    assert by_what.pop("Tensor.tolist") == ["step"]
    assert by_what.pop("Tensor.numpy") == ["step"]
    assert by_what.pop("Tensor.cpu") == ["step"]
    assert by_what.pop("aten.repeat_interleave.Tensor") == ["step"]  # without output_size
    assert by_what.pop("aten.bincount.default") == ["step"]
    assert by_what == {}
    assert "test_syncs.py" in sc.events[0].where
    # the patches are gone afterwards
    assert torch.Tensor.tolist.__name__ == "tolist" and torch.Tensor.cpu(x) is x


def test_counter_phases_and_watched_modules():
    lin = torch.nn.Linear(4, 4)

    class Item(torch.nn.Module):
        def forward(self, x):
            return lin(x) * float(x.sum() > 0)

    m = Item()
    x = torch.randn(3, 4)
    with SyncCounter() as sc, sc.watch(m, "fwd"):
        out = m(x)
        with sc.phase("mine"):
            out.sum().item()
        out.sum().backward()
        out.sum().item()
    assert sc.by_phase() == {"fwd": 1, "mine": 1, "step": 1}
    assert sc.count() == 3 and sc.count("fwd") == 1
    assert "1 x fwd" in sc.report()


# ----------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("T,N,p", [(37, 8, 0.3), (64, 16, 0.0), (5, 4, 1.0), (0, 4, 0.5)])
def test_device_plan_equals_the_host_plan(T, N, p):
    g = torch.Generator().manual_seed(T * N)
    mask = torch.rand(T, N, generator=g) < p
    host = dispatch.plan(mask, on_device=False)
    for num_pairs in (None, int(mask.sum())):
        with SyncCounter() as sc:
            dev = dispatch.plan(mask, num_pairs, on_device=True)
        assert sc.count() == (1 if num_pairs is None else 0), sc.report()
        assert dev.valid_P is None
        for a, b in ((host.token_idx_P, dev.token_idx_P), (host.expert_idx_P, dev.expert_idx_P),
                     (host.counts_N, dev.counts_N)):
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
        # device-side offsets into grouped_mm, as swiglu_grouped_mm builds them
        offs = dev.counts_N.cumsum(0).to(torch.int32)
        assert offs.dtype == torch.int32 and offs.shape == (N,) and int(offs[-1]) == dev.num_pairs


def test_fixed_k_routers_declare_their_pair_count():
    x = torch.randn(24, 32)
    ids = torch.randint(0, 100, (24,))
    from remoe.model.routers import RouterContext

    for name in FIXED_K + DATA_DEPENDENT:
        cfg = MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2, router=name)
        layer = MoELayer(cfg)
        r = layer.router(x, RouterContext(batch_size=2, seq_len=12, token_ids_T=ids, step=0))
        if name in FIXED_K:
            assert r.num_pairs == int(r.mask_TN.sum()), name
        else:
            assert r.num_pairs is None, name


# ----------------------------------------------------------------------------- one MoE layer

@pytest.mark.parametrize("router", FIXED_K + DATA_DEPENDENT)
@pytest.mark.parametrize("recompute", [False, True])
def test_moe_layer_forward_backward_on_grouped_mm(router, recompute):
    from remoe.model.routers import RouterContext

    torch.manual_seed(0)
    cfg = MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2, granularity=2, router=router,
                    expert_backend="grouped_mm", recompute_experts=recompute)
    layer = MoELayer(cfg)
    layer.static_plan = True  # train.dispatch_plan=static: no sync in the layer
    x = torch.randn(2, 16, 32, requires_grad=True)
    ctx = RouterContext(batch_size=2, seq_len=16, token_ids_T=torch.arange(32), step=0)
    with SyncCounter() as sc, sc.watch(layer, "forward"):
        y, aux = layer(x, ctx)
        ((y ** 2).sum() + aux.reg_loss + aux.aux_loss).backward()
    assert sc.by_phase() == {}, sc.report()
    assert x.grad is not None and layer.experts.w_in_ND2H.grad is not None


def test_grouped_mm_layer_equals_the_cpu_default():
    """The device plan feeds the same computation: grouped_mm vs the fused CPU default."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    for router in ("relu", "topk"):
        outs = []
        for backend in ("fused", "grouped_mm"):
            torch.manual_seed(1)
            layer = MoELayer(MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2,
                                       router=router, expert_backend=backend))
            outs.append(layer(x)[0])
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- a training step

@pytest.mark.parametrize("router", ["dense", "topk", "topk_auxfree", "relu", "blockffn"])
def test_training_step_syncs(router):
    from remoe.lab.bench.syncs import count_step_syncs

    res = count_step_syncs(router, grad_accum=2)
    msg = "\n".join(res["report"])
    assert res["step"] <= 1, msg  # the one copy of the step's sums, norm and counts
    assert res["backward"] == 0, msg
    assert res["forward"] == 0, msg
    assert res["total"] == res["step"]


def test_training_step_syncs_with_per_layer_lambdas_and_revival():
    from remoe.lab.bench.syncs import count_step_syncs

    res = count_step_syncs("relu", grad_accum=1,
                           extra=["model.sparsity_control=per_layer", "model.max_active=2",
                                  "model.balance_bias_rate=0.01"])
    assert (res["forward"], res["backward"], res["step"]) == (0, 0, 1), res["report"]


# ----------------------------------------------------------------------------- expert parallel

def _ep_worker(rank: int, init_file: str, world: int) -> None:
    from remoe.distributed.expert_parallel import ExpertParallel
    from remoe.model.routers import RouterContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        lines = []
        for router in ("topk", "relu"):
            torch.manual_seed(0)
            layer = MoELayer(MoEConfig.build(d_model=32, d_ffn=64, num_experts=8, top_k=2,
                                       router=router, expert_backend="grouped_mm"))
            ExpertParallel(layer)
            torch.manual_seed(10 + rank)
            x = torch.randn(24, 32, requires_grad=True)
            ctx = RouterContext(batch_size=1, seq_len=24)
            with SyncCounter() as sc, sc.watch(layer, "forward"):
                y, aux = layer(x, ctx)
                ((y ** 2).sum() + aux.reg_loss + aux.aux_loss).backward()
            # the split sizes (one copy), plus the plan's nonzero for data-dependent routing
            expected = {"forward": 1 if router == "topk" else 2}
            assert sc.by_phase() == expected, sc.report()
            lines.append(router)
        (Path(init_file).parent / f"passed_rank{rank}").write_text(" ".join(lines))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_adds_only_the_split_sizes(tmp_path):
    mp.spawn(_ep_worker, args=(str(tmp_path / "init"), 2), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("passed_rank*")) == ["passed_rank0",
                                                                    "passed_rank1"]
