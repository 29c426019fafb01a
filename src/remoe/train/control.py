"""The routing side of an optimizer step: the one sequence ``remoe train`` and ReMoETrainer run.

    coeffs(), revive_masks()   before the step: the lambda(s) of its loss and the revival input
                               of its forwards (``model(..., revive=)``), from the controller
    add(out)                   each micro-batch: its losses and routing counts (:class:`StepSums`)
    discard()                  the step is redone (capacity plan overflow): its sums dropped
    reduce(device, ...)        the step's one all-reduce and one copy to the host -> StepTotals
    after_step(totals)         after the optimizer update: the step's statistics
                               (remoe.method.sparsity), each token router's ``after_step`` (the
                               aux-loss-free bias, the thresholds), the controller's update, so
                               that every rank holds the same lambda (checked at checkpoints)
    split_dead(...)            ``revive_method: split`` (remoe train only): dead experts split
                               (:func:`split_expert`)

The controller (:class:`remoe.method.sparsity.SparsityControl`) holds the rules and their state;
this object holds nothing that a checkpoint needs. Under ``train.dispatch_plan=capacity``,
:class:`CapacityPlan` sizes each MoE layer's dispatch plan from the counts the step's sums
bring.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from remoe.method.sparsity import StepStatistics, build_controller, step_statistics
from remoe.model.routers import Router


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


def routed_ffns(model) -> list:
    """The FFN of every MoE layer of ``model`` with a token router, in the order of the rows of
    the step's expert counts."""
    return [b.ffn for b in model.layers if isinstance(getattr(b.ffn, "router", None), Router)]


class StepControl:
    """``controller``: a :class:`remoe.method.sparsity.SparsityControl` or None (no adaptive lambda);
    ``token_routers``: the token router of every MoE layer, in the order of the counts' rows;
    ``experts``: the expert module of each of those layers (needed by ``revive_method: split``)."""

    def __init__(self, controller, token_routers: list, experts: list | None = None) -> None:
        self.controller = controller
        self.token_routers = token_routers
        self.experts = experts
        self.sums: StepSums | None = None  # the micro-batches of the step under way
        self.splits: list[int] | None = None  # experts split per layer in the last step

    @classmethod
    def for_model(cls, model) -> StepControl:
        """The sequence of ``model``'s token routers (:func:`routed_ffns`) under the controller
        its config asks for (the paper's single lambda by default; per-layer / PI / revival on
        request; :func:`remoe.method.sparsity.build_controller`)."""
        routed = routed_ffns(model)
        return cls(build_controller(model.config, len(routed)), [f.router for f in routed],
                   [getattr(f, "experts", None) for f in routed])

    # -- before the step ----------------------------------------------------------------------
    def coeffs(self) -> tuple[float, list[float] | None]:
        """(lambda, per-layer lambdas or None) for this step's loss."""
        return (0.0, None) if self.controller is None else self.controller.coeffs()

    def revive_masks(self) -> list[torch.Tensor | None] | None:
        """The ``revive=`` argument of this step's forwards (None: no revival hinge)."""
        return None if self.controller is None else self.controller.revive_masks()

    # -- the micro-batches --------------------------------------------------------------------
    def add(self, out, num_tokens: int | None = None) -> None:
        """One micro-batch's forward output (a ReMoEOutput) into the step's sums."""
        if self.sums is None:
            self.sums = StepSums(per_layer=self.coeffs()[1] is not None)
        self.sums.add(out, num_tokens)

    def discard(self) -> None:
        """Drop the step under way (its sums and the routers' per-step state): it is redone."""
        self.sums = None
        for router in self.token_routers:
            router.discard_step()

    @property
    def pending(self) -> bool:
        """Whether micro-batches were added since the last :meth:`reduce`."""
        return self.sums is not None

    def reduce(self, device: torch.device | None, distributed: bool,
               grad_norm: torch.Tensor | float | None = None) -> StepTotals:
        """The step's sums over its micro-batches and all ranks (one all-reduce, one copy to
        the host, ``grad_norm`` in the same copy); starts the next step's sums."""
        sums, self.sums = self.sums, None
        return sums.reduce(device, distributed, grad_norm=grad_norm)

    # -- after the optimizer update -----------------------------------------------------------
    def after_step(self, tot: StepTotals) -> StepStatistics:
        """The step's statistics; the routers' own update, then the controller's."""
        stats = step_statistics(tot.counts_LN, tot.tokens)
        for router, counts_N in zip(self.token_routers, tot.counts_LN):  # routers with own state
            router.after_step(counts_N, tot.tokens)
        if self.controller is not None:
            self.controller.update(stats.sparsity, stats.layer_sparsity, tot.counts_LN.tolist(),
                                   tot.tokens)
        return stats

    def split_dead(self, counts_LN: torch.Tensor, optimizer, seed: int, step: int) -> None:
        """``revive_method: split``, after :meth:`after_step`: in each layer, the dead expert
        silent longest becomes a copy of the step's busiest live expert (:func:`split_expert`).
        Every rank holds the same counts and streaks, so every rank makes the same splits."""
        revival = self.controller.revival if self.controller is not None else None
        if revival is None or revival.method != "split" or not revival.silent:
            return
        self.splits = []
        for layer, (dead_N, counts_N) in enumerate(zip(revival.dead(), counts_LN.tolist())):
            pair = pick_split(dead_N, revival.silent[layer], counts_N)
            if pair is not None:
                e, b = pair
                router, experts = self.token_routers[layer], self.experts[layer]
                split_expert(router.weight, experts.w_in_ND2H, experts.w_out_NHD, e, b,
                             split_generator(seed, step, layer), optimizer)
                bias_N = getattr(router, "expert_bias_N", None)  # balance_bias_rate
                if bias_N is not None:
                    bias_N[e] = bias_N[b]
                revival.revived(layer, e)
            self.splits.append(int(pair is not None))

    def record(self, layer_coeffs: list[float] | None, reg_L: list[float] | None) -> dict[str, Any]:
        """Metrics of the sparsity-control options (nothing for the paper's controller)."""
        rec: dict[str, Any] = {}
        if layer_coeffs is not None:
            rec["lambda_layers"] = layer_coeffs  # the coefficients used in this step
            rec["reg_loss_layers"] = reg_L
        dead = self.controller.dead_experts() if self.controller else None
        if dead is not None:
            rec["reviving"] = [sum(row) for row in dead]  # experts under revival next step
        if self.splits is not None:
            rec["split"] = self.splits  # experts split in each layer at this step
        return rec

    def check_ranks_agree(self, device: torch.device, step: int) -> None:
        """Every rank must hold the same lambda (call on every rank of a distributed run)."""
        if self.controller is None:
            return
        values = self.controller.layer_coeffs or [self.controller.coeff]  # every layer's lambda
        lam = torch.tensor(values + [-v for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(lam, op=dist.ReduceOp.MAX)
        n = len(values)
        if not torch.equal(lam[:n], -lam[n:]):
            raise RuntimeError(f"ranks disagree on lambda at step {step}: "
                               f"max {lam[:n].tolist()} vs min {(-lam[n:]).tolist()}")


# ------------------------------------------------------------------------ revive_method: split
# ``model.revive_method: split``: a dead expert becomes a copy of the busiest expert of its layer.
#
# The revival hinge (remoe.model.routers.relu) pulls a dead expert's router row back toward
# tokens, but the expert it brings back is untrained, and each revived expert spends part of the
# sparsity budget on near-zero gates. Splitting instead puts the dead expert's parameters where
# the demand is: at most one dead expert per layer and step (the one silent longest) takes
#
# * the busiest live expert's ``w_in`` and half of its ``w_out`` (the donor keeps the other half),
#   so the layer computes the same function for every token of the donor;
# * the donor's router row plus Gaussian noise of ``NOISE`` x its RMS, so that the two copies
#   receive different tokens and gradients and drift apart;
# * the donor's optimizer moments (Adam's ``exp_avg`` / ``exp_avg_sq`` rows, any state tensor
#   shaped like the parameter).
#
# The noise is drawn from a generator seeded by (run seed, step, layer): every data-parallel rank
# makes the same split and an exact resume repeats it. Every expert's weights must be on every
# rank: expert parallel and FSDP refuse this option (remoe.experiment).

#: the copy's router row = donor's row + NOISE * rms(donor's row) * N(0, 1)
NOISE = 0.1


def pick_split(dead_N: list[bool], silent_N: list[int], counts_N: list[float]
               ) -> tuple[int, int] | None:
    """(dead expert, donor) for one layer, or None: the dead expert silent longest (ties: the
    lowest index) and the live expert with the most tokens this step (ties: the lowest index)."""
    dead = [e for e, d in enumerate(dead_N) if d]
    live = [e for e, d in enumerate(dead_N) if not d and counts_N[e] > 0]
    if not dead or not live:
        return None
    e = max(dead, key=lambda i: (silent_N[i], -i))
    b = max(live, key=lambda i: (counts_N[i], -i))
    return e, b


def _copy_state(optimizer: torch.optim.Optimizer | None, param: Tensor, e: int, b: int) -> None:
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    for v in state.values():
        if torch.is_tensor(v) and v.shape == param.shape:
            v[e].copy_(v[b])


@torch.no_grad()
def split_expert(router_weight_ND: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor, e: int, b: int,
                 generator: torch.Generator, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Make expert ``e`` a copy of expert ``b`` in place (parameters and optimizer state)."""
    for p in (router_weight_ND, w_in_ND2H, w_out_NHD):
        _copy_state(optimizer, p, e, b)
    w_in_ND2H[e].copy_(w_in_ND2H[b])
    w_out_NHD[b].mul_(0.5)
    w_out_NHD[e].copy_(w_out_NHD[b])
    row = router_weight_ND[b]
    noise = torch.randn(row.shape, generator=generator, dtype=torch.float32)
    scale = NOISE * row.float().pow(2).mean().sqrt()
    router_weight_ND[e].copy_(row + (scale * noise).to(row.device, row.dtype))


def split_generator(seed: int, step: int, layer: int) -> torch.Generator:
    """The noise generator of one split: the same on every rank and on a resumed run."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + layer)


# ----------------------------------------------------------------------------- capacity plan

class CapacityPlan:
    """``train.dispatch_plan=capacity``: the pair capacity of each MoE layer's on-device dispatch
    plan, for the next step, from the counts the step's one copy to the host already brings.

    A layer's capacity is the most pairs per token that one of its micro-batches held over the
    last ``window`` steps, times ``headroom``, times the tokens of a micro-batch, rounded up to a
    multiple of ``align`` rows. Before any step has been seen (the first step, a resume) it is
    :data:`FULL`: the layer's own bound (``T * N``, or ``T * max_active``). A step whose pairs
    did not fit is redone (the trainer) with :meth:`refit`: the pairs each layer needed, and if
    that does not fit either, :data:`FULL`. So no pair is ever dropped and every step's result
    is the exact plan's. Holds no state a checkpoint needs (a resumed run starts at FULL).
    """

    #: a capacity no layer reaches: the layer's own bound applies (MoELayer takes the minimum)
    FULL = 1 << 62

    def __init__(self, num_layers: int, headroom: float = 1.1, window: int = 16,
                 align: int = 64) -> None:
        self.num_layers, self.headroom, self.align = num_layers, headroom, align
        self.history: deque[list[float]] = deque(maxlen=window)  # pairs per token, per layer
        self.redone = 0  # steps redone after an overflow, over the run

    def _fit(self, per_token_L: list[float], tokens: int) -> list[int]:
        a = self.align
        return [max(a, math.ceil(p * tokens * self.headroom / a) * a) for p in per_token_L]

    def capacities(self, tokens: int) -> list[int]:
        """Each MoE layer's capacity for a step of ``tokens`` tokens per micro-batch."""
        if not self.history:
            return [self.FULL] * self.num_layers
        return self._fit([max(col) for col in zip(*self.history)], tokens)

    def record(self, pairs_max_L: list[float], tokens: int) -> None:
        """A finished step: each layer's most pairs in one micro-batch of ``tokens`` tokens."""
        self.history.append([p / tokens for p in pairs_max_L])

    def refit(self, pairs_max_L: list[float], tokens: int, attempt: int) -> list[int]:
        """The capacities to redo a step whose plan was cut (``attempt`` 1, 2, ...): the pairs
        the cut step counted (its counts are exact), then :data:`FULL`."""
        self.redone += 1
        if attempt > 1:
            return [self.FULL] * self.num_layers
        return self._fit([p / tokens for p in pairs_max_L], tokens)
