"""Expert parallelism: the EP experts equal the full experts; EP training equals data parallel."""

import copy
import json
import os
import shutil
import socket
import subprocess
import sys

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from remoe.errors import ConfigError
from remoe.experiment import check_expert_parallel
from remoe.experiment import load_config
from remoe.train.trainer import Trainer

WORLD = 2


# ----------------------------------------------------------------------------- unit (spawn)


@pytest.fixture
def make_overrides(make_overrides):
    """The multi-process tests' micro overrides with the short schedule these tests assume
    (6 steps of 4 x 32 tokens, evaluated and saved every 3, masks every 2)."""
    short = {"train.micro_batch_size": 4, "train.max_steps": 6, "train.eval_every": 3,
             "train.save_every": 3, "analysis.record_masks_every": 2}
    return lambda out_dir, name, **extra: make_overrides(out_dir, name, **{**short, **extra})

def _unit_worker(rank: int, init_file: str) -> None:
    from remoe.model import dispatch
    from remoe.distributed.expert_parallel import ExpertParallel, ExpertParallelExperts
    from remoe.model.experts import SwiGLUExperts
    from remoe.model.moe import MoEConfig, MoELayer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        N, D, H = 8, 16, 8
        torch.manual_seed(0)
        full = SwiGLUExperts(N, D, H, backend="reference")  # same weights on both ranks
        rng_before = torch.get_rng_state()
        ep = ExpertParallelExperts(full)
        assert torch.equal(torch.get_rng_state(), rng_before)  # building EP draws no numbers
        assert ep.num_experts == N // WORLD and ep.w_in_ND2H.shape == (N // WORLD, D, 2 * H)
        # per-rank data; the cases cover idle experts, an idle owner rank and an idle sender
        cases = [
            torch.rand(13 + 7 * rank, N) < 0.4,  # generic
            (torch.arange(N) < 4).expand(5, N).clone(),  # only rank 0's experts receive rows
            torch.zeros(6, N, dtype=torch.bool) if rank == 1 else torch.rand(9, N) < 0.5,
            torch.zeros(4, N, dtype=torch.bool),  # nobody routes anything
        ]
        gen = torch.Generator().manual_seed(100 + rank)
        for mask_TN in cases:
            T = mask_TN.shape[0]
            x_TD = torch.randn(T, D, generator=gen)
            plan = dispatch.plan(mask_TN)
            x_PD = dispatch.permute(x_TD, plan)
            x1 = x_PD.clone().requires_grad_(True)
            x2 = x_PD.clone().requires_grad_(True)
            y_ref = full(x1, plan.counts_N)
            y_ep = ep(x2, plan.counts_N)
            torch.testing.assert_close(y_ep, y_ref, rtol=1e-6, atol=1e-6)
            # backward: input grads equal; the local weight grads sum every rank's tokens
            g = torch.randn(y_ref.shape, generator=gen)
            if y_ref.requires_grad:  # (the reference returns a constant without rows)
                (y_ref * g).sum().backward()
            (y_ep * g).sum().backward()  # EP always joins the other rank's reverse exchange
            gx1 = torch.zeros_like(x1) if x1.grad is None else x1.grad
            torch.testing.assert_close(x2.grad, gx1, rtol=1e-5, atol=1e-6)
            n = N // WORLD
            for name in ("w_in_ND2H", "w_out_NHD"):
                gf = getattr(full, name).grad
                gf = torch.zeros_like(getattr(full, name)) if gf is None else gf.clone()
                dist.all_reduce(gf)
                ge = getattr(ep, name).grad
                ge = torch.zeros_like(getattr(ep, name)) if ge is None else ge
                torch.testing.assert_close(ge, gf[rank * n:(rank + 1) * n], rtol=1e-5, atol=1e-6)
            full.zero_grad(set_to_none=True)
            ep.zero_grad(set_to_none=True)
        # eval-mode forward without autograd
        with torch.no_grad():
            x_PD = torch.randn(10, D, generator=gen)
            counts = torch.tensor([1, 0, 3, 0, 0, 2, 4, 0])
            torch.testing.assert_close(ep(x_PD, counts), full(x_PD, counts), rtol=1e-6, atol=1e-6)

        # a whole MoE layer (gates, dispatch, combine) and one training step: EP against data
        # parallelism emulated on a full copy (gradients averaged over the ranks, as DDP does)
        torch.manual_seed(1)
        layer = MoELayer(MoEConfig.build(d_model=D, d_ffn=4 * H, num_experts=N, top_k=2,
                                   router="relu"))  # auto: fused (full) vs grouped_mm (EP)
        ref = copy.deepcopy(layer)
        handle = ExpertParallel(layer)
        assert isinstance(layer.experts, ExpertParallelExperts)
        assert set(handle.params) == {"experts.w_in_ND2H", "experts.w_out_NHD"}
        x = torch.randn(2, 7, D, generator=gen)
        y_ref, _ = ref(x)
        y_ep, _ = layer(x)
        torch.testing.assert_close(y_ep, y_ref, rtol=1e-6, atol=1e-6)
        y_ref.square().sum().backward()
        y_ep.square().sum().backward()
        # DDP: every gradient of the full copy, only the replicated ones (router) with EP
        for p in [*ref.parameters(), *(p for p in layer.parameters()
                                       if not handle.is_expert_param(p))]:
            dist.all_reduce(p.grad)
            p.grad.div_(WORLD)
        handle.finish_grads()  # EP: the expert gradients / W
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)  # clips by ~1/2
        norm_ep = handle.clip_grad_norm_(list(layer.parameters()), max_norm)
        torch.testing.assert_close(norm_ep, norm_ref, rtol=1e-6, atol=0)
        ref_sd = dict(ref.named_parameters())
        for name, p in layer.named_parameters():  # the clipped gradients
            g_ref = ref_sd[name].grad
            if name in handle.params:
                g_ref = handle._slice(g_ref, p)
            torch.testing.assert_close(p.grad, g_ref, rtol=1e-5, atol=1e-8, msg=name)
        # the full model (gathered) and the full optimizer state round-trip through the slices
        with handle.full_experts():
            assert type(layer.experts) is SwiGLUExperts and layer.experts.num_experts == N
            full_sd = {k: v.clone() for k, v in layer.state_dict().items()}
        assert isinstance(layer.experts, ExpertParallelExperts)
        for k, v in ref.state_dict().items():
            assert torch.equal(full_sd[k], v), k
        sharded = handle.shard_state_dict(full_sd)
        for k, v in layer.state_dict().items():
            assert torch.equal(sharded[k], v), k
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        opt_ref.step()
        opt.step()
        gathered = handle.gather_optimizer_state(opt)
        for i, st in opt_ref.state_dict()["state"].items():  # the layout without EP
            for k, v in st.items():
                torch.testing.assert_close(gathered["state"][i][k], v, rtol=1e-5, atol=1e-12)
        back = handle.shard_optimizer_state(gathered, opt)
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                assert torch.equal(back["state"][i][k], v)
        (Path(init_file).parent / f"passed_rank{rank}").write_text("ok")  # every check above held
    finally:
        dist.destroy_process_group()


def test_ep_experts_equal_full_experts(tmp_path):
    mp.spawn(_unit_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
    assert sorted(p.name for p in tmp_path.glob("passed_rank*")) == [f"passed_rank{r}"
                                                                     for r in range(WORLD)]


# ----------------------------------------------------------------------------- config

def test_config_validation(make_overrides, tmp_path):
    ok = load_config(None, make_overrides(tmp_path, "ok", **{"train.expert_parallel": "true"}))
    assert ok.train.expert_parallel is True
    with pytest.raises(ConfigError, match="train.expert_parallel.*model.router='dense'"):
        load_config(None, make_overrides(tmp_path, "x", **{"train.expert_parallel": "true",
                                                            "model.router": "dense"}))
    with pytest.raises(ConfigError, match="train.expert_parallel.*lory"):
        load_config(None, make_overrides(tmp_path, "x", **{"train.expert_parallel": "true",
                                                            "model.router": "lory"}))
    with pytest.raises(ConfigError, match="unknown key train.distributed"):
        load_config(None, make_overrides(tmp_path, "x", **{"train.distributed": "fsdp"}))
    with pytest.raises(ConfigError, match="train.expert_parallel.*divisible by the world size"):
        check_expert_parallel("relu", 8, 3)
    check_expert_parallel("hash", 8, 4)
    check_expert_parallel("topk", 6, 1)  # one process: a no-op
    # one process: plain training, the experts stay whole
    t = Trainer(ok, progress=False)
    assert t.ep is None and t.model.layers[0].ffn.experts.num_experts == 8


# ----------------------------------------------------------------------------- torchrun

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(overrides, resume=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           f"--master_port={free_port()}", "-m", "remoe.cli", "train", "--no-progress"]
    cmd += (["--resume"] if resume else []) + [f"--set={o}" for o in overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def metrics(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def weights(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_ep_training_matches_data_parallel(make_overrides, tmp_path):
    common = {"train.max_steps": 4, "train.eval_every": 0, "train.save_every": 2,
              "train.keep_last": 2, "analysis.record_masks_every": 2, "train.num_threads": 1,
              "train.micro_batch_size": 2, "train.grad_accum": 2}
    dp = make_overrides(tmp_path, "dp", **common)
    ep = make_overrides(tmp_path, "ep", **common, **{"train.expert_parallel": "true"})
    torchrun(dp)
    torchrun(ep)
    a, b = metrics(tmp_path / "dp" / "metrics.jsonl"), metrics(tmp_path / "ep" / "metrics.jsonl")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert rb["step_tokens"] == ra["step_tokens"]
        assert rb["lm_loss"] == pytest.approx(ra["lm_loss"], rel=1e-4)
        assert rb["reg_loss"] == pytest.approx(ra["reg_loss"], rel=1e-4)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)  # global norm
        assert rb["lambda"] == ra["lambda"]
    assert a[0]["expert_counts"] == b[0]["expert_counts"]

    # the saved models hold all experts and agree; so do the (gathered) optimizer states
    for sub in ("final", "checkpoints/step_0000004"):
        wa, wb = weights(tmp_path / "dp" / sub), weights(tmp_path / "ep" / sub)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert wa[k].shape == wb[k].shape, k
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-5, msg=k)
    sa = torch.load(tmp_path / "dp/checkpoints/step_0000004/trainer_state.pt", weights_only=True)
    sb = torch.load(tmp_path / "ep/checkpoints/step_0000004/trainer_state.pt", weights_only=True)
    for i, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert sb["optimizer"]["state"][i][k].shape == v.shape
            torch.testing.assert_close(sb["optimizer"]["state"][i][k], v, rtol=1e-4, atol=1e-6)
    sum_a, sum_b = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("dp", "ep"))
    assert sum_b["params_total"] == sum_a["params_total"]
    assert sum_b["params_active"] == sum_a["params_active"]
    assert sum_b["val_loss"] == pytest.approx(sum_a["val_loss"], rel=1e-4)
    masks = sorted(p.name for p in (tmp_path / "ep" / "routing").iterdir())
    assert masks == ["masks_0000000.npz", "masks_0000002.npz", "masks_0000004.npz"]

    # --resume from step 2 continues bit-exactly (each rank slices the full checkpoint)
    shutil.copytree(tmp_path / "ep", tmp_path / "ep_resumed")
    ckpts = tmp_path / "ep_resumed" / "checkpoints"
    shutil.rmtree(ckpts / "step_0000004")
    (ckpts / "LATEST").write_text("step_0000002")
    torchrun(make_overrides(tmp_path, "ep_resumed", **common,
                            **{"train.expert_parallel": "true"}), resume=True)
    c = metrics(tmp_path / "ep_resumed" / "metrics.jsonl")
    assert [r["step"] for r in c] == [1, 2, 3, 4]
    for rb, rc in zip(b[2:], c[2:]):
        for k in ("lm_loss", "reg_loss", "lambda", "grad_norm", "expert_counts"):
            assert rc[k] == rb[k], k
    wb, wc = weights(tmp_path / "ep" / "final"), weights(tmp_path / "ep_resumed" / "final")
    for k in wb:
        assert torch.equal(wc[k], wb[k]), k
