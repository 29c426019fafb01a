"""What one step's micro-batches add up to, reduced once over the data-parallel ranks.

Per rank, each micro-batch adds its LM, L_reg and L_aux losses, its token count, its routing
counts ``[L, N]`` and (per-layer control) each layer's L_reg, as float64 CPU tensors (no
collective per micro-batch). :meth:`StepSums.reduce` packs them into one vector, all-reduces it
once, and returns the step's means and totals.
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
    counts_LN: torch.Tensor  # [L_moe, N] float64: tokens routed to each expert, all ranks
    reg_L: list[float] | None  # per-layer control: mean of each MoE layer's L_reg


class StepSums:
    def __init__(self, per_layer: bool) -> None:
        self.per_layer = per_layer
        self.sums = torch.zeros(4, dtype=torch.float64)  # lm, reg, aux, tokens (per rank)
        self.counts: torch.Tensor | None = None
        self.reg_L: torch.Tensor | None = None  # sum over micro-batches of each layer's L_reg

    def add(self, out, num_tokens: int) -> None:
        """Add one micro-batch's forward output ``out`` (a ReMoEOutput) of ``num_tokens`` tokens."""
        aux = out.aux
        self.sums += torch.stack([out.loss.detach().double().cpu(),
                                  aux.reg_loss.detach().double().cpu(),
                                  aux.aux_loss.detach().double().cpu(),
                                  torch.tensor(float(num_tokens), dtype=torch.float64)])
        c = aux.active_counts_LN.detach().double().cpu()
        self.counts = c if self.counts is None else self.counts + c
        if self.per_layer:
            r = aux.reg_losses_L.detach().double().cpu()
            self.reg_L = r if self.reg_L is None else self.reg_L + r

    def reduce(self, n_micro: int, device: torch.device, distributed: bool) -> StepTotals:
        """One all-reduce (when ``distributed``) of everything the step reports; ``n_micro`` is
        the number of micro-batches over all ranks."""
        counts = self.counts
        packed = torch.cat([self.sums, counts.flatten()]
                           + ([self.reg_L] if self.reg_L is not None else []))
        if distributed:
            packed = packed.to(device)
            dist.all_reduce(packed)
            packed = packed.cpu()
        lm, reg, aux, tokens = (packed[:4] / torch.tensor([n_micro, n_micro, n_micro, 1])).tolist()
        counts_LN = packed[4:4 + counts.numel()].view_as(counts)
        reg_L = None
        if self.reg_L is not None:
            reg_L = (packed[4 + counts.numel():] / n_micro).tolist()
        return StepTotals(lm, reg, aux, tokens, counts_LN, reg_L)
