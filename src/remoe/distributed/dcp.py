"""Sharded checkpoints of ``train.fsdp=true`` runs (``torch.distributed.checkpoint``, DCP).

A sharded checkpoint directory ``checkpoints/step_<step>/`` holds::

    dcp/              model and AdamW state, every rank writing its own shards (DCP files)
    config.json       the model config (what the weights are)
    trainer_state.pt  step, tokens, lambda controller, RNG, data position (no optimizer)
    checksums.json    size and sha256 of every file, written last (remoe.rundir)

It is written into a temporary sibling and renamed into place by rank 0 once every rank has
written its shards, then ``LATEST`` is replaced, as for full checkpoints
(:mod:`remoe.train.checkpoint`, whose format is unchanged for runs without FSDP). DCP stores
every tensor with its global shape and each shard's offsets, so the checkpoint loads at any
world size: FSDP-sharded tensors are DTensors already, and the expert slices of expert
parallelism are declared as ``Shard(0)`` DTensors of the full expert tensor (keys are the
full model's names, :class:`~remoe.distributed.expert_parallel.ExpertParallel`). With one process
the model is plain and DCP reads (or writes) whole tensors. The state dicts come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (parameter names, not ids, key the
optimizer state). The run's ``final/`` stays a consolidated Hugging Face directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from remoe import rundir
from remoe.rundir import dcpread
from remoe.errors import ConfigError

DCP_METADATA = rundir.DCP_METADATA


def check_checkpoint_kind(ckpt: Path, fsdp: bool) -> None:
    """Refuse (one line) to resume a sharded checkpoint without FSDP, or a full one with it."""
    if dcpread.is_sharded(ckpt) and not fsdp:
        raise ConfigError(f"--resume: {Path(ckpt).name} is a sharded checkpoint (written with "
                          "train.fsdp=true); resume it with --set train.fsdp=true")
    if fsdp and not dcpread.is_sharded(ckpt):
        raise ConfigError(f"--resume: train.fsdp=true resumes sharded checkpoints only; "
                          f"{Path(ckpt).name} is a full one (resume it with train.fsdp=false)")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ep_mesh(ep):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(ep.group) if ep.group is not None else list(
        range(dist.get_world_size()))
    device_type = next(iter(ep.params.values())).device.type
    return DeviceMesh.from_group(ep.group or dist.group.WORLD, device_type,
                                 mesh=torch.tensor(ranks))


def _as_dtensor(local: Tensor, mesh) -> Tensor:
    from torch.distributed.tensor import DTensor, Shard

    W = mesh.size()
    shape = (local.shape[0] * W,) + tuple(local.shape[1:])
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def training_state(model, optimizer, ep=None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for DCP: sharded tensors as DTensors, the expert slices
    of expert parallelism as ``Shard(0)`` DTensors of the full expert tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    if ep is not None:
        mesh = _ep_mesh(ep)
        for name, p in ep.params.items():
            if name in msd:
                msd[name] = _as_dtensor(msd[name], mesh)
            st = osd.get("state", {}).get(name)
            if st:
                osd["state"][name] = {k: (_as_dtensor(v, mesh) if isinstance(v, Tensor)
                                          and v.shape == p.shape else v) for k, v in st.items()}
    return {"model": msd, "optim": osd}


def _ep_to_local(sd: dict[str, Any], ep) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    def local(v):
        return v.to_local() if isinstance(v, DTensor) else v

    if ep is None:
        return sd
    for name in ep.params:
        if name in sd["model"]:
            sd["model"][name] = local(sd["model"][name])
        st = sd["optim"].get("state", {}).get(name)
        if st:
            sd["optim"]["state"][name] = {k: local(v) for k, v in st.items()}
    return sd


def save_sharded(ckpt_root: Path, step: int, model, optimizer, state: dict[str, Any],
                 keep_last: int, ep=None) -> Path:
    """Collective: write ``ckpt_root/step_<step>`` (see the module doc), point LATEST at it and
    prune old checkpoints. ``state``: the trainer state without the optimizer."""
    import torch.distributed.checkpoint as dcp

    main = not dist.is_initialized() or dist.get_rank() == 0
    name = f"step_{step:07d}"
    final = ckpt_root / name
    tmp = rundir.temp_path(final)  # rank 0's name (it holds the pid), shared by all ranks
    if dist.is_initialized():
        names = [str(tmp)]
        dist.broadcast_object_list(names, src=0)
        tmp = Path(names[0])
    if main:
        with rundir.writing(ckpt_root):
            ckpt_root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
    _barrier()
    dcp.save(training_state(model, optimizer, ep), checkpoint_id=str(tmp / dcpread.DCP_DIR))
    _barrier()  # every rank's shards are on disk
    if main:
        with rundir.writing(final, cleanup=tmp):
            getattr(model, "config").to_json_file(tmp / "config.json")
            torch.save({**state, rundir.MANIFEST_KEY: True}, tmp / rundir.STATE_FILE)
            rundir.write_manifest(tmp)
            rundir.replace_dir(tmp, final)
        rundir.atomic_write_text(ckpt_root / rundir.LATEST, name)
        if keep_last > 0:
            for old in rundir.checkpoint_dirs(ckpt_root)[keep_last:]:
                rundir.remove_dir(old)
    _barrier()
    return final


def load_sharded(ckpt: Path, model, optimizer, ep=None) -> None:
    """Collective: load the model and optimizer state of a sharded checkpoint (any world size)
    into this rank's shards. The files are read through :mod:`remoe.rundir.dcpread` (an allow-list
    unpickler for ``.metadata``, ``weights_only`` for the rest): a crafted file runs nothing."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = training_state(model, optimizer, ep)
    # never torch's own reader: it unpickles .metadata with plain pickle (remoe.rundir.dcpread)
    dcpread.load(sd, Path(ckpt) / dcpread.DCP_DIR)
    sd = _ep_to_local(sd, ep)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
