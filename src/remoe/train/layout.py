"""How the model is laid out over the processes: expert parallelism (each rank keeps a slice of
every MoE layer's experts, :mod:`remoe.distributed.expert_parallel`) and the DDP wrapper of plain data
parallelism. FSDP2 is :mod:`remoe.distributed.fsdp`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from remoe.model import registry


def setup_expert_parallel(model: torch.nn.Module, tc, model_cfg, info):
    """Replace every MoE layer's experts by this rank's slice (None: off or one process)."""
    if not tc.expert_parallel:
        return None
    from remoe.distributed.expert_parallel import shard_experts
    from remoe.experiment import check_expert_parallel

    check_expert_parallel(model_cfg.routing.router, model_cfg.routing.num_routed,
                          info.world_size)
    if not info.enabled:
        return None
    # a group of its own: the expert exchanges never interleave with DDP's all-reduces
    return shard_experts(model, dist.new_group())


def wrap_data_parallel(model: torch.nn.Module, info, device: torch.device, ep, fsdp, router: str):
    """DDP around ``model`` under torchrun without FSDP (the model itself otherwise); the experts
    of an expert-parallel model are left to their own all-to-all and gradient averaging."""
    if not info.enabled or fsdp is not None:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ep is not None:  # each rank owns different experts: DDP must not touch them
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ep.params))
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=not registry.declares(router, "uses_all_params"))
