"""FSDP2 (remoe.distributed.fsdp) and sharded checkpoints (remoe.distributed.dcp) on gloo, in spawned
processes with a deadline (a hang fails the test instead of stalling it).

Two ranks, rank 1's first router forced to route no token (only rank 0 feeds that layer's
experts: no deadlock, no missing gradient): one FSDP step, and one FSDP + expert-parallel step,
equal a single model accumulating both ranks' batches (loss, gradient norm, weights); the
sharded checkpoints they write load into a plain model in one process. Resuming across world
sizes through the trainer: tests/parallel/test_fsdp_train.py.
"""

import copy
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 240
VOCAB = 384


def _model(seed: int = 0):
    from remoe.model.config import PRESETS, ReMoEConfig
    from remoe.model import ReMoEForCausalLM

    torch.manual_seed(seed)
    # the reference expert backend (GPU's fallback) returns a constant when an expert layer
    # gets no row: the stacked expert weights then have no gradient on that rank
    return ReMoEForCausalLM(ReMoEConfig(**{**PRESETS["micro"], "vocab_size": VOCAB,
                                           "expert_backend": "reference"}))


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(2)]  # rank 0, rank 1


def _silence_router(model):
    """Rank 1's view: layer 0's router activates no expert for any token."""
    from remoe.model.routers.base import Routing

    def hook(module, args, out):
        return Routing(out.gates_TN * 0.0, torch.zeros_like(out.mask_TN), out.reg_loss,
                       out.aux_loss)

    return model.layers[0].ffn.router.register_forward_hook(hook)


def _step(model, x, coeff=1e-2):
    from remoe.method.sparsity import total_loss

    out = model(input_ids=x, labels=x, train_step=0)
    total_loss(out, coeff, None).backward()
    return float(out.loss.detach())


def _one_layout(rank: int, world: int, root: pathlib.Path, use_ep: bool) -> None:
    from remoe.method.sparsity import total_loss
    from remoe.distributed import dcp
    from remoe.distributed.fsdp import shard_model

    model = _model()
    # the reference: the same model accumulating both ranks' batches in one process (AdamW
    # with a large eps: the update is ~lr * g, so it carries the gradients' agreement)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1.0)
    xs = _batches()
    ref_losses = []
    for r, x in enumerate(xs):
        h = _silence_router(ref) if r == 1 else None
        out = ref(input_ids=x, labels=x, train_step=0)
        (total_loss(out, 1e-2, None) / world).backward()
        ref_losses.append(float(out.loss.detach()))
        if h is not None:
            h.remove()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    ref_opt.step()

    ep = None
    if use_ep:
        from remoe.distributed.expert_parallel import shard_experts

        ep = shard_experts(model, dist.new_group())
    sm = shard_model(model, torch.device("cpu"), ep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0)
    if rank == 1:
        _silence_router(model)
    loss = _step(model, xs[rank])
    assert loss == pytest.approx(ref_losses[rank], rel=1e-6)
    if ep is not None:
        ep.finish_grads()
    norm = sm.clip_grad_norm_(list(model.parameters()), 0.5)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with (ep.full_experts() if ep is not None else torch.no_grad()):
        full = sm.full_state_dict()  # collective; rank 0 holds it
    if rank == 0:
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-7, msg=k)
        torch.save(full, root / f"full-{int(use_ep)}.pt")
    dcp.save_sharded(root / f"ckpt-{int(use_ep)}", 1, model, opt, {"step": 1}, keep_last=2,
                     ep=ep)


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank,
                            world_size=world)
    try:
        for use_ep in (False, True):
            _one_layout(rank, world, pathlib.Path(root), use_ep)
        (pathlib.Path(root) / f"ok-{rank}").write_text("ok")  # every check above held
    finally:
        dist.destroy_process_group()


def _spawn(world: int, root) -> None:
    ctx = mp.start_processes(_worker, args=(world, str(root)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} FSDP processes did not finish in {DEADLINE_S} s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    assert sorted(p.name for p in root.glob("ok-*")) == [f"ok-{r}" for r in range(world)]


def test_fsdp_step_equals_one_process_and_checkpoint_loads_on_one(tmp_path):
    _spawn(2, tmp_path)
    from remoe.distributed import dcp

    for use_ep in (0, 1):
        ckpt = tmp_path / f"ckpt-{use_ep}" / "step_0000001"
        assert sorted(p.name for p in ckpt.iterdir()) == ["checksums.json", "config.json",
                                                           "dcp", "trainer_state.pt"]
        assert (ckpt.parent / "LATEST").read_text() == "step_0000001"
        # one process, no process group: DCP reads whole tensors into a plain model
        model = _model(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dcp.load_sharded(ckpt, model, opt)
        want = torch.load(tmp_path / f"full-{use_ep}.pt", weights_only=True)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert len(opt.state) == len(list(model.parameters()))  # AdamW moments loaded
