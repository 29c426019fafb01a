"""What one step's micro-batches add up to, reduced once over the data-parallel ranks.

Per rank, each micro-batch adds its LM, L_reg and L_aux losses, its token count, itself (the
micro-batches are counted, so ranks or steps with fewer of them average right), its routing
counts ``[L, N]`` and (per-layer control) each layer's L_reg, as float64 tensors on the model's
device (no collective and no host synchronisation per micro-batch). :meth:`StepSums.reduce`
packs them into one vector (with the step's gradient norm when given), all-reduces it once and
copies it to the host once: the step's only device->host synchronisation outside the model
(counted by ``tests/model/test_syncs.py``). On the capacity plan (``model(..., capacity=)``)
the same copy carries the step's overflows (summed over ranks: every rank redoes the step
together) and, per MoE layer, the most pairs one micro-batch of this rank held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepTotals:
    lm: float  # mean over the step's micro-batches (all ranks) of the LM loss
    reg: float  # ... of L_reg
    aux: float  # ... of L_aux
    tokens: float  # tokens of the step, all ranks
    counts_LN: torch.Tensor  # [L_moe, N] float64 (host): tokens routed to each expert, all ranks
    reg_L: list[float] | None  # per-layer control: mean of each MoE layer's L_reg
    grad_norm: float | None = None  # the gradient norm handed to reduce() (not summed)
    #: capacity plan: MoE layers x micro-batches (all ranks) whose plan was cut (0: exact step)
    overflow: float = 0.0
    #: capacity plan: per MoE layer, the most pairs one micro-batch of this rank held; else None
    pairs_max_L: list[float] | None = None


class StepSums:
    def __init__(self, per_layer: bool) -> None:
        self.per_layer = per_layer
        # lm, reg, aux, tokens, micro-batches (per rank, on the device)
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.reg_L: torch.Tensor | None = None  # sum over micro-batches of each layer's L_reg
        self.overflow: torch.Tensor | None = None  # capacity plan: cut plans, summed
        self.pairs_max_L: torch.Tensor | None = None  # capacity plan: max pairs of a micro-batch

    def add(self, out, num_tokens: int | None = None) -> None:
        """Add one micro-batch's forward output ``out`` (a ReMoEOutput) of ``num_tokens`` tokens
        (default: the tokens its routers saw, ``out.aux.num_tokens``)."""
        aux = out.aux
        # no LM loss when the caller computes it itself (transformers' compute_loss_func)
        loss = out.loss.detach() if out.loss is not None else aux.reg_loss.detach().new_zeros(())
        if num_tokens is None:
            num_tokens = aux.num_tokens
        if self.sums is None:
            self.sums = torch.zeros(5, dtype=torch.float64, device=loss.device)
        self.sums += torch.stack([loss.double(), aux.reg_loss.detach().double().to(loss.device),
                                  aux.aux_loss.detach().double().to(loss.device),
                                  torch.full((), float(num_tokens), dtype=torch.float64,
                                             device=loss.device),
                                  torch.ones((), dtype=torch.float64, device=loss.device)])
        c = aux.active_counts_LN.detach().double()
        self.counts = c if self.counts is None else self.counts + c
        if self.per_layer:
            r = aux.reg_losses_L.detach().double()
            self.reg_L = r if self.reg_L is None else self.reg_L + r
        if getattr(aux, "overflow", None) is not None:
            o, p = aux.overflow.detach().double().reshape(1), c.sum(1)
            self.overflow = o if self.overflow is None else self.overflow + o
            self.pairs_max_L = p if self.pairs_max_L is None else torch.maximum(self.pairs_max_L, p)

    def reduce(self, device: torch.device | None, distributed: bool,
               grad_norm: torch.Tensor | float | None = None) -> StepTotals:
        """One all-reduce (when ``distributed``; on ``device``, default where the sums are) of
        everything the step reports and one copy to the host; the losses are means over the
        step's micro-batches on all ranks. ``grad_norm`` (the same on every rank, not summed)
        travels in the same copy."""
        if device is None:
            device = self.sums.device
        counts = self.counts
        reg_L = self.reg_L
        capacity = self.overflow is not None
        packed = torch.cat([self.sums.to(device), counts.flatten().to(device)]
                           + ([reg_L.to(device)] if reg_L is not None else [])
                           + ([self.overflow.to(device)] if capacity else []))
        if distributed:
            dist.all_reduce(packed)
        pairs_max_L = overflow = None
        if capacity:  # this rank's own maxima, after the sum over ranks
            packed = torch.cat([packed, self.pairs_max_L.to(device)])
        if grad_norm is not None:
            g = torch.as_tensor(grad_norm, dtype=torch.float64)
            packed = torch.cat([packed, g.to(device=device, dtype=torch.float64).reshape(1)])
        packed = packed.cpu()  # the step's one device -> host copy
        if grad_norm is not None:
            packed, grad_norm = packed[:-1], packed[-1].item()
        if capacity:
            L = counts.shape[0]
            pairs_max_L, packed = packed[-L:].tolist(), packed[:-L]
            overflow, packed = packed[-1].item(), packed[:-1]
        n_micro = packed[4]
        lm, reg, aux = (packed[:3] / n_micro).tolist()
        tokens = packed[3].item()
        counts_LN = packed[5:5 + counts.numel()].view_as(counts)
        reg_list = None
        if reg_L is not None:
            reg_list = (packed[5 + counts.numel():] / n_micro).tolist()
        return StepTotals(lm, reg, aux, tokens, counts_LN, reg_list, grad_norm,
                          overflow or 0.0, pairs_max_L)
