"""ReMoE's sparsity, in one place: the training objective, what a step reports about its
routing, and the adaptive control of the L1 penalty (paper eq. 6-7, 10) with the project's
options.

``total_loss`` is ``L = L_lm + lambda * L_reg + L_aux`` (paper eq. 10; with per-layer control
``(1/L) sum_l lambda_l L_reg,l``), shared by the trainer and ``remoe bench``.
``step_statistics`` turns the routing counts of a step (``active_counts_LN``: tokens routed to
each expert of each MoE layer) into the sparsity ``S = 1 - active pairs / (L T N)`` (eq. 7),
per-layer sparsity, active experts per token (overall and per layer), effective experts and
dead (never-firing) experts, with the formulas of ``remoe.model.losses``.

The paper's controller (the default): ``lambda_{i+1} = lambda_i * alpha ** sign((1 - k/E) - S_i)``,
one lambda shared by all layers, updated once per optimizer step from the sparsity of the whole
step, kept in float64 on the host and checkpointed through ``state_dict``.

Options (``model.sparsity_control`` / ``model.lambda_update``; docs/CONTROL.md):

* ``lambda_update="pi"``: a proportional-integral step in log space on the relative density
  error ``e = (d - d*) / d*`` (``d = 1 - S``, ``d* = k/E``)::

      log lambda += log(alpha) * clip(kp * (e_i - e_{i-1}) + ki * e_i, -1, 1)

  far from the target (``ki * e >= 1``; stage I: ``e`` up to E/k - 1) the step saturates at
  the paper's ``alpha``; near the target it shrinks with the error, which removes the
  stage-III limit cycle of the sign rule (a full ``alpha`` step every step, whatever the
  error), but also makes the final approach slower (measured in docs/RESULTS.md; a larger
  ``ki`` keeps full steps closer to the target).
* ``sparsity_control="per_layer"``: one lambda per MoE layer, each with its own rule state,
  driven by its own layer's sparsity (:class:`SparsityControl` holds them).
* :class:`ExpertRevival` counts, per layer and expert, the consecutive steps in which the
  expert received no token; experts silent for ``revive_after`` steps get their router's
  revival hinge (remoe.model.routers.relu; the dead experts go into the next forward as
  ``revive=``, :meth:`SparsityControl.revive_masks`) or, with ``revive_method="split"``, become
  copies of busy experts (remoe.train.control.split_expert).

:class:`SparsityControl` is the one object the trainers hold (``remoe train`` and
``ReMoETrainer``, both through :class:`remoe.train.control.StepControl`): the lambda(s), each a
:class:`LambdaController` (the rule and its state), and the optional :class:`ExpertRevival`,
behind one ``state_dict`` whose formats are those of every earlier version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from remoe.model import registry
from remoe.model.losses import effective_experts_of, layer_sparsity_of, sparsity_of
from remoe.model.spec import LAMBDA_UPDATES, SparsityControlConfig

def total_loss(out: Any, coeff: float = 0.0, layer_coeffs: list[float] | None = None):
    """The training objective of one forward ``out`` (a ReMoEOutput with ``labels``).

    ``coeff`` is the single lambda (the paper); ``layer_coeffs`` one lambda per MoE layer
    (``model.sparsity_control=per_layer``), which then replaces ``coeff``.
    """
    aux = out.aux
    reg_L = aux.reg_losses_L if layer_coeffs is not None else None
    return out.loss + penalty(coeff, aux.reg_loss, layer_coeffs, reg_L) + aux.aux_loss


def penalty(coeff: Any, reg: Any, layer_coeffs: list[float] | None = None,
            reg_L: Any = None) -> Any:
    """lambda * L_reg, the one definition: the paper's single lambda times L_reg (the mean over
    MoE layers), or with per-layer control the mean of lambda_l * L_reg,l. On tensors for the
    loss (:func:`total_loss`), on floats for the logged value of a step."""
    if layer_coeffs is None:
        return coeff * reg
    if isinstance(reg_L, torch.Tensor):
        lam_L = torch.tensor(layer_coeffs, dtype=reg_L.dtype, device=reg_L.device)
        return (lam_L * reg_L).mean()
    return sum(a * b for a, b in zip(layer_coeffs, reg_L)) / len(reg_L)


@dataclass(frozen=True)
class StepStatistics:
    """The routing numbers of one step (or forward), as logged in ``metrics.jsonl``."""

    sparsity: float  # S over all MoE layers
    layer_sparsity: list[float]  # S of each MoE layer
    active_k: float  # mean active experts per token and layer
    dead_experts: list[int]  # experts of each MoE layer that received no token
    active_pairs: float  # (token, expert) pairs routed, summed over layers
    layer_active_k: list[float] = field(default_factory=list)  # experts per token of each layer
    effective_experts: list[float] = field(default_factory=list)  # exp(entropy of the load)


def step_statistics(counts_LN: torch.Tensor, num_tokens: float) -> StepStatistics:
    """The statistics of ``counts_LN`` ([L_moe, N] tokens per expert) over ``num_tokens`` tokens
    (per layer; all zeros / empty for a model without MoE layers)."""
    L = counts_LN.shape[0]
    active_pairs = float(counts_LN.sum())
    if L == 0:
        return StepStatistics(0.0, [], 0.0, [], active_pairs)
    return StepStatistics(sparsity=float(sparsity_of(counts_LN, num_tokens)),
                          layer_sparsity=layer_sparsity_of(counts_LN, num_tokens).tolist(),
                          active_k=active_pairs / (L * num_tokens),
                          dead_experts=(counts_LN == 0).sum(1).tolist(),
                          active_pairs=active_pairs,
                          layer_active_k=(counts_LN.to(torch.float64).sum(1) / num_tokens).tolist(),
                          effective_experts=effective_experts_of(counts_LN).tolist())


_DEFAULT = SparsityControlConfig()


def _finite(sparsity) -> float:
    s = float(sparsity)
    if not math.isfinite(s):
        raise ValueError(f"sparsity={s!r} is not finite")
    return s


@dataclass
class LambdaController:
    target_sparsity: float  # 1 - k/E
    # defaults: the model config's control section (remoe.model.spec), declared there once
    lambda0: float = _DEFAULT.lambda0
    alpha: float = _DEFAULT.alpha
    value: float | None = None  # current lambda_i (None -> lambda0)
    steps: int = 0  # number of updates applied
    rule: str = _DEFAULT.lambda_update  # "sign" (eq. 6) | "pi"
    kp: float = _DEFAULT.lambda_pi_kp  # pi: weight of the change in relative density error
    ki: float = _DEFAULT.lambda_pi_ki  # pi: weight of the relative density error
    prev_error: float | None = None  # pi: e_{i-1}
    floor: float = _DEFAULT.lambda_floor  # lambda never falls below this (0: no floor)

    def __post_init__(self) -> None:
        if self.value is None:
            self.value = float(self.lambda0)
        if self.rule not in LAMBDA_UPDATES:
            raise ValueError(f"rule={self.rule!r} must be one of {LAMBDA_UPDATES}")

    @property
    def coeff(self) -> float:
        """lambda_i, the coefficient of L_reg in the current step's loss."""
        return float(self.value)

    def update(self, sparsity: float) -> float:
        """Apply the update rule with the step's measured sparsity S_i; returns lambda_{i+1}.

        ``sparsity`` may be a python float or a 0-d tensor (``MoEAux.sparsity``).
        """
        sparsity = _finite(sparsity)
        if self.rule == "sign":
            gap = self.target_sparsity - sparsity
            sign = (gap > 0) - (gap < 0)
            self.value = float(self.value) * self.alpha ** sign
        else:
            self.value = float(self.value) * self.alpha ** self.pi_step(sparsity)
        if self.floor > 0 and self.value < self.floor:  # (configuration, not checkpointed)
            self.value = float(self.floor)
        self.steps += 1
        return self.value

    def pi_step(self, sparsity: float) -> float:
        """The PI rule's step in units of log(alpha), in [-1, 1] (updates ``prev_error``)."""
        target_density = 1.0 - self.target_sparsity
        error = ((1.0 - sparsity) - target_density) / target_density
        prev = error if self.prev_error is None else self.prev_error
        self.prev_error = error
        return max(-1.0, min(1.0, self.kp * (error - prev) + self.ki * error))

    def state_dict(self) -> dict:
        state = {"target_sparsity": self.target_sparsity, "lambda0": self.lambda0,
                 "alpha": self.alpha, "value": self.value, "steps": self.steps}
        if self.rule != "sign":  # the paper's controller keeps its original checkpoint format
            state.update(rule=self.rule, kp=self.kp, ki=self.ki, prev_error=self.prev_error)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.target_sparsity = float(state["target_sparsity"])
        self.lambda0 = float(state["lambda0"])
        self.alpha = float(state["alpha"])
        self.value = float(state["value"])
        self.steps = int(state["steps"])
        self.rule = str(state.get("rule", "sign"))
        self.kp = float(state.get("kp", self.kp))
        self.ki = float(state.get("ki", self.ki))
        prev = state.get("prev_error")
        self.prev_error = None if prev is None else float(prev)


@dataclass
class ExpertRevival:
    """Consecutive starving steps per (layer, expert); experts starving ``after`` steps in a
    row are dead. An expert starves in a step when it gets at most ``below`` of the step's
    tokens (``below = 0``: only when it gets none). With ``until > 0`` a dead expert stays dead
    (its streak keeps growing) until a step gives it at least ``until`` of the tokens
    (hysteresis: the revival hinge stays on until the expert is back near its fair share).

    ``method``: ``"hinge"`` (dead experts get their router's revival hinge) or ``"split"`` (the
    trainer turns a dead expert into a copy of a busy one, then calls :meth:`revived`)."""

    after: int
    silent: list[list[int]] = field(default_factory=list)  # [L][N]
    below: float = 0.0
    until: float = 0.0
    method: str = "hinge"

    def update(self, counts_LN, num_tokens: float | None = None) -> list[list[bool]]:
        """Feed the step's routed-token counts [L][N] (and its token count, needed when
        ``below > 0`` or ``until > 0``); returns the dead mask [L][N]."""
        counts = [[float(v) for v in row] for row in counts_LN]
        if (self.below > 0 or self.until > 0) and num_tokens is None:
            raise ValueError("ExpertRevival(below > 0 or until > 0) needs the step's token count")
        floor = self.below * num_tokens if self.below > 0 else 0.0
        release = self.until * num_tokens if self.until > 0 else None
        if not self.silent:
            self.silent = [[0] * len(row) for row in counts]

        def starving(s: int, c: float) -> bool:
            if release is not None and s >= self.after:
                return c < release
            return c <= floor

        self.silent = [[(s + 1) if starving(s, c) else 0 for s, c in zip(srow, crow)]
                       for srow, crow in zip(self.silent, counts)]
        return self.dead()

    def dead(self) -> list[list[bool]]:
        return [[s >= self.after for s in row] for row in self.silent]

    def revived(self, layer: int, expert: int) -> None:
        """The expert was given a new start (split): its starving streak begins again."""
        self.silent[layer][expert] = 0

    def state_dict(self) -> dict:
        # ``below``, ``until`` and ``method`` are configuration (model.revive_below /
        # revive_until / revive_method), not state: they are not checkpointed
        return {"after": self.after, "silent": [list(r) for r in self.silent]}

    def load_state_dict(self, state: dict) -> None:
        self.after = int(state["after"])
        self.silent = [[int(v) for v in r] for r in state["silent"]]


class SparsityControl:
    """Everything the trainers steer for a ReLU-routed model, behind one ``state_dict``.

    ``lams``: one :class:`LambdaController` for all layers (the paper), or one per MoE layer
    (``per_layer``); ``revival``: an optional :class:`ExpertRevival`. The paper's configuration
    (one lambda, no revival) checkpoints exactly as a bare LambdaController does; the others as
    ``{"lambda": <one lambda's state> | {"per_layer": [...]}, "revival": <state> | None}``.
    """

    def __init__(self, lams: list[LambdaController], per_layer: bool = False,
                 revival: ExpertRevival | None = None) -> None:
        if not per_layer and len(lams) != 1:
            raise ValueError(f"one lambda for all layers, got {len(lams)}")
        self.lams = list(lams)
        self.per_layer = per_layer
        self.revival = revival

    # -- before a step ------------------------------------------------------------------------
    @property
    def coeff(self) -> float:
        """lambda_i (per-layer control: the mean over layers, what a single lambda would be
        for the same total pressure)."""
        if not self.per_layer:
            return self.lams[0].coeff
        return sum(self.layer_coeffs) / max(1, len(self.lams))

    @property
    def layer_coeffs(self) -> list[float] | None:
        """lambda_{i,l} per MoE layer (None: one lambda for all layers)."""
        return [c.coeff for c in self.lams] if self.per_layer else None

    def coeffs(self) -> tuple[float, list[float] | None]:
        """(lambda, per-layer lambdas or None): the coefficients of this step's loss."""
        return self.coeff, self.layer_coeffs

    def start(self, values: list[float]) -> None:
        """Set the current lambda(s) (one value, or one per layer; a single lambda takes the
        mean of several)."""
        if self.per_layer:
            vals = values if len(values) == len(self.lams) else [values[0]] * len(self.lams)
            for c, v in zip(self.lams, vals):
                c.value = float(v)
        else:
            self.lams[0].value = float(sum(values) / len(values))

    def dead_experts(self) -> list[list[bool]] | None:
        """[L][N] experts under revival for the next step (None: revival off or no step yet)."""
        return self.revival.dead() if self.revival is not None and self.revival.silent else None

    def revive_masks(self) -> list[torch.Tensor | None] | None:
        """The revival hinge's input to the next forward (``model(..., revive=)``): per MoE
        layer a bool ``[N]`` of its dead experts, or None for a layer with none; None when no
        layer has one (the plain forward) or revival is not the hinge."""
        if self.revival is None or self.revival.method != "hinge":
            return None
        dead = self.dead_experts()
        if dead is None or not any(any(row) for row in dead):
            return None
        return [torch.tensor(row, dtype=torch.bool) if any(row) else None for row in dead]

    # -- after a step ---------------------------------------------------------------------------
    def update(self, sparsity: float, layer_sparsity: list[float], counts_LN,
               num_tokens: float | None = None) -> None:
        """One optimizer step's measurements (all ranks reduced) -> the next coefficients
        (``num_tokens``: the step's tokens, for ``model.revive_below`` / ``revive_until``)."""
        if self.per_layer:
            if len(layer_sparsity) != len(self.lams):
                raise ValueError(f"got {len(layer_sparsity)} layer sparsities for "
                                 f"{len(self.lams)} controllers")
            for c, s in zip(self.lams, layer_sparsity):
                c.update(s)
        else:
            self.lams[0].update(sparsity)
        if self.revival is not None:
            self.revival.update(counts_LN, num_tokens)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        lam = ({"per_layer": [c.state_dict() for c in self.lams]} if self.per_layer
               else self.lams[0].state_dict())
        if not self.per_layer and self.revival is None:
            return lam
        return {"lambda": lam,
                "revival": self.revival.state_dict() if self.revival is not None else None}

    def load_state_dict(self, state: dict) -> None:
        nested = "lambda" in state and isinstance(state["lambda"], dict)
        if not (self.per_layer or self.revival is not None):
            if nested:
                raise ValueError("checkpoint holds per-layer / revival control state; this run "
                                 "asks for the paper's single lambda")
            self.lams[0].load_state_dict(state)
            return
        if not nested:
            raise ValueError("checkpoint holds the paper's single-lambda state; this run "
                             "asks for per-layer control or expert revival")
        lam = state["lambda"]
        if self.per_layer:
            if "per_layer" not in lam or len(lam["per_layer"]) != len(self.lams):
                raise ValueError("checkpoint holds no per-layer lambda state for "
                                 f"{len(self.lams)} layers (was it trained with "
                                 "model.sparsity_control=global?)")
            for c, one in zip(self.lams, lam["per_layer"]):
                c.load_state_dict(one)
        else:
            if "per_layer" in lam:
                raise ValueError("checkpoint holds per-layer lambda state; this run asks for "
                                 "one lambda (model.sparsity_control=global)")
            self.lams[0].load_state_dict(lam)
        if self.revival is not None and state.get("revival") is not None:
            self.revival.load_state_dict(state["revival"])


def lambdas_in(state: dict) -> list[float] | None:
    """The current lambda(s) held by a controller ``state_dict`` of any format (the paper's,
    nested with revival, per layer); None if it holds none."""
    lam = state["lambda"] if isinstance(state.get("lambda"), dict) else state
    if "per_layer" in lam:
        return [float(c["value"]) for c in lam["per_layer"]]
    return [float(lam["value"])] if "value" in lam else None


def build_controller(cfg, num_moe_layers: int) -> SparsityControl | None:
    """The sparsity control of a model config (a ``ReMoEConfig`` or ``ModelSpec``): built from
    its control section, steering to its routing section's target; None when the router does
    not declare ``uses_adaptive_reg``."""
    if not registry.declares(cfg.routing.router, "uses_adaptive_reg"):
        return None
    c, target = cfg.control, cfg.routing.target_sparsity

    def one() -> LambdaController:
        return LambdaController(target, c.lambda0, c.alpha, rule=c.lambda_update,
                                kp=c.lambda_pi_kp, ki=c.lambda_pi_ki, floor=c.lambda_floor)

    per_layer = c.sparsity_control == "per_layer"
    revival = ExpertRevival(c.revive_after, below=c.revive_below, until=c.revive_until,
                            method=c.revive_method) if c.revive_after > 0 else None
    return SparsityControl([one() for _ in range(num_moe_layers if per_layer else 1)],
                           per_layer, revival)
