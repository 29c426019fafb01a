"""The inference-time compute dial of ReLU routing: loss vs active experts as tau grows.

A ReLU router's gates are continuous, so a trained ReMoE can drop its weakest (token, expert)
pairs at inference: with ``gate_threshold`` tau, gates <= tau count as inactive (tau = 0 is the
trained model, exactly). ``threshold_sweep`` evaluates the held-out loss and the mean number of
active experts per token and MoE layer for each tau: a quality/compute curve that a TopK model
cannot offer (its k is fixed).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from remoe.errors import ConfigError


def relu_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from remoe.model.routers.relu import ReLURouter

    return [m for m in model.modules() if isinstance(m, ReLURouter)]


@torch.no_grad()
def measure(model: torch.nn.Module, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
    """Token-weighted loss and mean active experts per token per MoE layer on ``batches``."""
    nll, tokens, pairs, routed_tokens, layers = 0.0, 0, 0.0, 0, 0
    for batch in batches:
        ids = torch.as_tensor(batch[0], device=device).long()
        if ids.shape[0] == 0 or ids.shape[1] < 2:
            continue
        out = model(input_ids=ids[:, :-1])
        targets = ids[:, 1:]
        nll_T = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                targets.reshape(-1), reduction="none")
        nll += float(nll_T.double().sum())  # float64 sums, as remoe.model.losses.evaluate_loss
        tokens += targets.numel()
        counts_LN = out.aux.active_counts_LN
        layers = counts_LN.shape[0]
        pairs += float(counts_LN.sum())
        routed_tokens += out.aux.num_tokens
    if tokens == 0:
        raise ConfigError("--gate-threshold: the evaluation split has no tokens")
    loss = nll / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)),
            "active_experts": pairs / max(1, routed_tokens * max(1, layers)), "tokens": tokens}


def threshold_sweep(model: torch.nn.Module, make_batches, taus: list[float],
                    device: torch.device | str = "cpu") -> list[dict[str, float]]:
    """One row per tau: ``{"tau", "loss", "ppl", "active_experts", "tokens"}``.

    ``make_batches()`` returns a fresh iterable of ``(input_ids [B, S+1], ...)`` each call. The
    model's own thresholds are restored afterwards.
    """
    routers = relu_routers(model)
    if not routers:
        raise ConfigError("--gate-threshold needs a ReLU-routed model (model.router=relu)")
    bad = [t for t in taus if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0)]
    if bad:
        raise ConfigError(f"--gate-threshold={bad[0]!r} must be a finite number >= 0")
    saved = [r.gate_threshold for r in routers]
    was_training = model.training
    model.eval()
    rows = []
    try:
        for tau in taus:
            for r in routers:
                r.gate_threshold = float(tau)
            rows.append({"tau": float(tau), **measure(model, make_batches(), torch.device(device))})
    finally:
        for r, t in zip(routers, saved):
            r.gate_threshold = t
        model.train(was_training)
    return rows


def format_sweep(name: str, rows: list[dict[str, float]], experts: int) -> str:
    head = f"{name}: gate-threshold sweep (inference only; tau = 0 is the trained model)"
    lines = [head, f"{'tau':>8}  {'loss':>8}  {'ppl':>9}  {'experts/token':>13}  "
             f"{'of ' + str(experts):>7}"]
    for r in rows:
        lines.append(f"{r['tau']:>8.4g}  {r['loss']:>8.4f}  {r['ppl']:>9.2f}  "
                     f"{r['active_experts']:>13.3f}  {r['active_experts'] / experts:>7.1%}")
    return "\n".join(lines)
