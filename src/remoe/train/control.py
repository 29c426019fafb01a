"""The sparsity-control side of a training step (the trainer's view of remoe.method.sparsity).

Before the step: the lambda(s) its loss uses and the experts whose revival hinge is on. After
the optimizer update: each token router's ``after_step`` (the aux-loss-free bias update), the
controller's update from the step's statistics, reduced over all ranks, so that every rank
holds the same lambda (checked at each checkpoint), and (``revive_method: split``) the splits
of dead experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from remoe.method.losses import StepStatistics
from remoe.train.revive_split import pick_split, split_expert, split_generator


class StepControl:
    """``controller``: a :class:`remoe.method.sparsity.SparsityControl` or None (no adaptive lambda);
    ``token_routers``: the token router of every MoE layer, in the order of the counts' rows;
    ``experts``: the expert module of each of those layers (needed by ``revive_method: split``)."""

    def __init__(self, controller, token_routers: list, experts: list | None = None) -> None:
        self.controller = controller
        self.token_routers = token_routers
        self.experts = experts
        self.splits: list[int] | None = None  # experts split per layer in the last step

    @property
    def _revival(self):
        return self.controller.revival if self.controller is not None else None

    def coeffs(self) -> tuple[float, list[float] | None]:
        """(lambda, per-layer lambdas or None) for this step's loss."""
        if self.controller is None:
            return 0.0, None
        return self.controller.coeff, self.controller.layer_coeffs

    def arm_revival(self) -> None:
        """Hand each ReLU router the experts whose revival hinge is on for this step."""
        if self._revival is None or self._revival.method != "hinge":
            return
        dead = self.controller.dead_experts()
        if dead is None:
            return
        for router, row in zip(self.token_routers, dead):  # revival: ReLU routers only
            router.set_dead_experts(torch.tensor(row, dtype=torch.bool))

    def after_step(self, counts_LN: torch.Tensor, stats: StepStatistics,
                   num_tokens: float | None = None) -> None:
        """After the optimizer update: the routers' own update, then the controller's
        (``num_tokens``: the step's tokens over all ranks, for ``model.revive_below``)."""
        for router, counts_N in zip(self.token_routers, counts_LN):  # routers with own state
            with_tokens = getattr(router, "after_step_with_tokens", None)  # (a Router has it)
            if with_tokens is not None:
                with_tokens(counts_N, num_tokens)
            else:
                router.after_step(counts_N)
        if self.controller is not None:
            self.controller.update(stats.sparsity, stats.layer_sparsity, counts_LN.tolist(),
                                   num_tokens)

    def split_dead(self, counts_LN: torch.Tensor, optimizer, seed: int, step: int) -> None:
        """``revive_method: split``, after :meth:`after_step`: in each layer, the dead expert
        silent longest becomes a copy of the step's busiest live expert (remoe.train.revive_split).
        Every rank holds the same counts and streaks, so every rank makes the same splits."""
        revival = self._revival
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
