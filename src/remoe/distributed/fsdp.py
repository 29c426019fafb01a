"""Fully sharded data parallel (``train.fsdp=true``): FSDP2 over the decoder blocks and the root.

Every decoder block is one ``torch.distributed.fsdp.fully_shard`` unit (its parameters, sharded
along dim 0 over the W ranks, are all-gathered for its forward and backward and its gradients
reduce-scattered, averaged over the ranks as DDP averages them); the root unit holds the
embedding, the final norm and the LM head. With ``train.expert_parallel=true`` the experts of
every token-routed MoE layer are already split by expert parallelism
(:mod:`remoe.distributed.expert_parallel`): FSDP ignores them (``ignored_params``) and
:meth:`ExpertParallel.finish_grads` averages their gradients, so the two compose.

Mixed precision (CUDA with bf16 only): parameters are all-gathered and computed in bf16,
gradients reduced in fp32, the sharded master weights and AdamW state stay fp32 (lambda is a
host-side fp32 number of the controller). On CPU (gloo, the tests) everything is fp32.

Every rank takes part in every collective: the forward of every unit is one (all-gather), so
routing-mask recording and evaluation run on all ranks. FSDP2 reduce-scatters the gradients
of exactly the parameters that have one, so a parameter must not lose its gradient on some
ranks only: the experts of a MoE layer whose tokens on this rank all went to no expert would
(the stacked expert weights take part in no product). :func:`_keep_expert_grads` ties them to
the layer output with a zero factor, which changes no value and no other gradient.

:class:`ShardedModel` is the trainer's handle: global gradient-norm clipping (sharded DTensor
gradients + expert-parallel gradients) and the full (consolidated) state dict for ``final/``.
With one process (``torchrun --nproc_per_node=1`` or plain ``remoe train``) nothing is
sharded; the handle still writes and reads sharded (DCP) checkpoints, so a run can move
between world sizes (:mod:`remoe.distributed.dcp`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from remoe.model.experts import SwiGLUExperts
from remoe.model.moe import MoELayer


def _keep_expert_grads(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a MoE layer: ``y + 0 * (one weight of each stacked expert tensor)``.

    The sum is exact (``y + 0.0 == y``) and adds an exact zero to the gradient, but it gives
    the expert weights a gradient on every rank even when no token of this rank was routed.
    """
    y, aux = output
    experts = module.experts
    tie = experts.w_in_ND2H.reshape(-1)[:1].to(y.dtype) + experts.w_out_NHD.reshape(-1)[:1].to(y.dtype)
    return y + tie.reshape(()) * 0.0, aux


class ShardedModel:
    """The FSDP side of one model (see the module doc); ``sharded`` is False with one process."""

    def __init__(self, model: nn.Module, device: torch.device, ep=None,
                 bf16: bool = False) -> None:
        self.model, self.device, self.ep = model, device, ep
        self.model_cls = type(model)  # fully_shard swaps the class for an FSDP subclass
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.sharded = self.world_size > 1
        self.mesh = None
        if not self.sharded:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.mesh = init_device_mesh(device.type, (self.world_size,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 and device.type == "cuda" else MixedPrecisionPolicy())
        ignored = set(ep.params.values()) if ep is not None else None
        self.hooks = []
        for block in model.layers:
            ffn = getattr(block, "ffn", None)
            if isinstance(ffn, MoELayer) and type(ffn.experts) is SwiGLUExperts:
                self.hooks.append(ffn.register_forward_hook(_keep_expert_grads))
            fully_shard(block, mesh=self.mesh, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mesh=self.mesh, mp_policy=mp, ignored_params=ignored)

    # -- gradients ------------------------------------------------------------------------
    # (the trainer's gradient hooks of remoe.train.optim: finish_grads, clip_grad_norm_)
    def finish_grads(self) -> None:
        """FSDP averaged the sharded gradients in its reduce-scatter; average the experts'."""
        if self.ep is not None:
            self.ep.finish_grads()

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[Tensor], max_norm: float) -> float:
        """The global L2 norm of the gradients of ``params`` (sharded ones + every rank's
        experts), clipped to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` clips
        (``max_norm`` 0: no clipping)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        sharded = [g for g in grads if isinstance(g, DTensor)]
        local = [g for g in grads if not isinstance(g, DTensor)]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if sharded:
            norm = torch.nn.utils.get_total_norm(sharded)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            sq = sq + norm.double() ** 2
        if local:
            loc_sq = torch.nn.utils.get_total_norm(local).double() ** 2
            if self.sharded and self.ep is not None:  # the local grads are this rank's experts
                dist.all_reduce(loc_sq, group=self.ep.group)
            sq = sq + loc_sq
        total = float(sq.sqrt())
        if max_norm > 0:
            coef = max_norm / (total + 1e-6)  # as clip_grads_with_norm_
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return total

    # -- consolidated weights -------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Tensor]:
        """Collective: the full model state dict on CPU on rank 0 (``{}`` on the others).

        Under expert parallelism call it inside ``ExpertParallel.full_experts()`` (the experts
        are then whole, plain tensors on every rank)."""
        if not self.sharded:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
        return sd if dist.get_rank() == 0 else {}

    def consolidated_model(self) -> nn.Module | None:
        """Collective: on rank 0 a plain (unsharded, CPU) copy of the model holding the full
        weights, e.g. for ``save_pretrained`` (None on the other ranks). Built on the meta
        device (no initialisation, no random numbers drawn), then given the gathered tensors."""
        sd = self.full_state_dict()
        if self.sharded and dist.get_rank() != 0:
            return None
        with torch.device("meta"):
            plain = self.model_cls(self.model.config)
        plain.load_state_dict(sd, assign=True)
        return plain


def shard_model(model: nn.Module, device: torch.device, ep=None,
                bf16: bool = False) -> ShardedModel:
    """Apply FSDP2 to ``model`` in place (each decoder block, then the root)."""
    return ShardedModel(model, device, ep, bf16)
