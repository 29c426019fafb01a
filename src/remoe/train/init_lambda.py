"""The first lambda of a run started from existing weights (``train.init_from``, and the
Hugging Face Trainer's callback): the value that fits the model as it is, or the one a run
checkpoint saved when it still fits (docs/CONTINUE.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remoe.train.init_from import InitModel


def initial_lambda(model, inputs, per_layer: bool, dist_enabled: bool = False,
                   routers: list | None = None) -> tuple[list[float] | None, dict[str, Any]]:
    """Lambda(s) that fit the model as it is: the gradient balance at the routers.

    On one training micro-batch, ``g_lm`` and ``g_reg`` are the gradients of the LM loss and
    of ``L_reg`` with respect to the router weights (all MoE layers, or each layer with
    per-layer control); lambda = ``|g_lm| / |g_reg|``, the value at which the L1 term pulls
    on the routers as hard as the language-modelling loss does. The controller then moves it
    by alpha per step in whichever direction the density asks, starting from its working
    range instead of from ``lambda0``. Squared norms are summed over data-parallel ranks (the
    same lambda on every rank). Returns ``(lambdas, measurements)``; ``lambdas`` is None when
    the routers get no L_reg gradient (no active pair): then ``model.lambda0`` stays.

    ``inputs``: token ids ``[B, S]`` (labels = inputs), or the keyword arguments of the
    forward (``input_ids``, ``labels``, ...); ``routers``: the token routers (default: those of
    ``model.layers``; a PEFT-wrapped model passes the active ones).
    """
    import torch
    import torch.distributed as dist

    from remoe.train.control import routed_ffns

    if routers is None:
        routers = [f.router for f in routed_ffns(model)]
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs, "labels": inputs, "train_step": 0}
    input_ids = inputs["input_ids"]
    weights = [r.weight for r in routers]
    was = model.training
    model.train()
    out = model(**inputs)
    g_lm = torch.autograd.grad(out.loss, weights, retain_graph=True, allow_unused=True)
    g_reg = torch.autograd.grad(out.aux.reg_loss, weights, allow_unused=True)
    model.train(was)

    def sq(gs):
        return torch.stack([(g.double() ** 2).sum() if g is not None else
                            torch.zeros((), dtype=torch.float64, device=input_ids.device)
                            for g in gs])

    sums = torch.stack([sq(g_lm), sq(g_reg)])  # [2, L]
    counts = out.aux.active_counts_LN.double().sum(1)
    tokens = torch.tensor([float(input_ids.numel())], dtype=torch.float64, device=counts.device)
    extra = torch.cat([counts, tokens])
    if dist_enabled:
        dist.all_reduce(sums)
        dist.all_reduce(extra)
    lm, reg = sums[0].tolist(), sums[1].tolist()
    n_tok = float(extra[-1])
    density = [c / (n_tok * r.num_experts) for c, r in zip(extra[:-1].tolist(), routers)]
    if per_layer:
        lams = [math.sqrt(a / b) if b > 0 else None for a, b in zip(lm, reg)]
        if any(v is None for v in lams):
            lams = None
    else:
        lams = [math.sqrt(sum(lm) / sum(reg))] if sum(reg) > 0 else None
    info = {"lambda_rule": "gradient balance |g_lm| / |g_reg| at the routers, one micro-batch",
            "source_density": sum(density) / max(1, len(density)),
            "source_layer_density": density}
    return lams, info


def saved_lambda(model_dir: Path, model_cfg) -> tuple[list[float], str] | None:
    """The lambda(s) the remoe run that wrote ``model_dir`` would have used next -- a run
    checkpoint's controller state, or the ``final_lambda`` in the summary of the run whose
    ``final/`` it is -- when this run's controller is the one it had (same router, target and
    per-layer or not). That lambda fits the model by construction."""
    from remoe import ReMoEConfig, rundir

    model_dir = Path(model_dir)
    if not model_cfg.uses_adaptive_reg or not (model_dir / "config.json").is_file():
        return None
    try:
        saved_cfg = ReMoEConfig.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - not a remoe directory: nothing saved to reuse
        return None
    old, new = saved_cfg.spec, model_cfg.spec
    same = (old.routing.router == new.routing.router
            and old.routing.target_sparsity == new.routing.target_sparsity
            and old.control.sparsity_control == new.control.sparsity_control
            and old.backbone.num_layers == new.backbone.num_layers)
    if not same:
        return None
    if (model_dir / rundir.STATE_FILE).is_file():
        from remoe.method.sparsity import lambdas_in

        state = rundir.load_state(model_dir).get("controller")
        values = lambdas_in(state) if state else None
        if values:
            return values, "the checkpoint's own lambda"
    from remoe.rundir.card import find_run_dir

    run = find_run_dir(model_dir)
    if run is not None and model_dir.name == "final" and (run / "summary.json").is_file():
        try:
            final = json.loads((run / "summary.json").read_text(encoding="utf-8"))["final_lambda"]
        except (OSError, ValueError, KeyError):
            return None
        if isinstance(final, (int, float)) and final > 0:
            return [float(final)], "the source run's final lambda"
    return None


def pick_lambda(model_cfg, fixed: float | None, saved: tuple[list[float], str] | None,
                measured: list[float] | None, info: dict[str, Any]
                ) -> tuple[list[float] | None, str]:
    """The controller's first lambda(s) and why (None: ``model.lambda0``): ``fixed``
    (train.init_lambda), else the saved one, else the gradient balance where the model is
    denser than its target (per layer with per-layer control); a model (layer) already at or
    below its target density starts at ``model.lambda0``: it needs no pressure yet, and the
    controller raises lambda by alpha per step as soon as it gets denser."""
    if fixed is not None:
        return [float(fixed)], "train.init_lambda"
    if saved is not None:
        return saved
    if measured is None:
        return None, "model.lambda0 (no L_reg gradient)"
    target = model_cfg.routing.target_density
    lam0 = float(model_cfg.control.lambda0)
    if model_cfg.control.sparsity_control == "per_layer":
        dens = info.get("source_layer_density") or []
        vals = [m if d > target else lam0 for m, d in zip(measured, dens)]
        return vals, (f"gradient balance per layer where the density is above {target:.3g}, "
                      "else model.lambda0")
    d0 = info.get("source_density", 0.0)
    if d0 > target:
        return measured, (f"gradient balance |g_lm| / |g_reg| at the routers (density "
                          f"{d0:.3f} above the target {target:.3f})")
    return None, f"model.lambda0 (density {d0:.3f} at or below the target {target:.3f})"


def choose_lambda(init: InitModel, fixed: float | None, input_ids, dist_enabled: bool) -> None:
    """Set ``init.lambdas`` (:func:`pick_lambda`) and record how they were chosen."""
    cfg = init.model.config
    lams, measured = initial_lambda(init.model, input_ids,
                                    cfg.control.sparsity_control == "per_layer",
                                    dist_enabled)
    saved = saved_lambda(init.source.model_dir, cfg) if init.source.model_type == "remoe" else None
    init.lambdas, rule = pick_lambda(cfg, fixed, saved, lams, measured)
    init.lambda_info = {**measured, "measured_lambda": lams, "lambda_rule": rule}
