"""One optimizer step's sparsity side: the one sequence ``remoe train`` and ``ReMoETrainer`` both run.

    coeffs(), revive_masks()   before the step: the lambda(s) of its loss and the revival input
                               of its forwards (``model(..., revive=)``), from the controller
    add(out)                   each micro-batch: its losses and routing counts (accumulate.py)
    discard()                  the step is redone (capacity plan overflow): its sums dropped
    reduce(device, ...)        the step's one all-reduce and one copy to the host -> StepTotals
    after_step(totals)         after the optimizer update: the step's statistics
                               (remoe.method.losses), each token router's ``after_step`` (the
                               aux-loss-free bias, the thresholds), the controller's update, so
                               that every rank holds the same lambda (checked at checkpoints)
    split_dead(...)            ``revive_method: split`` (remoe train only): dead experts split

The controller (:class:`remoe.method.sparsity.SparsityControl`) holds the rules and their state;
this object holds nothing that a checkpoint needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from remoe.method.losses import StepStatistics, step_statistics
from remoe.train.accumulate import StepSums, StepTotals
from remoe.train.revive_split import pick_split, split_expert, split_generator


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
        silent longest becomes a copy of the step's busiest live expert (remoe.train.revive_split).
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
