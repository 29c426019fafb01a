"""The losses of the method, in one place: the training objective, what a step reports about
its routing, and the held-out loss.

``total_loss`` is ``L = L_lm + lambda * L_reg + L_aux`` (paper eq. 10; with per-layer control
``(1/L) sum_l lambda_l L_reg,l``), shared by the trainer and ``remoe bench``.

``step_statistics`` turns the routing counts of a step (``active_counts_LN``: tokens routed to
each expert of each MoE layer) into the sparsity ``S = 1 - active pairs / (L T N)`` (paper
eq. 7), per-layer sparsity, active experts per token (overall and per layer), effective experts
and dead (never-firing) experts, with the formulas of one forward's ``MoEAux``
(``remoe.model.losses.sparsity_of`` / ``layer_sparsity_of``) and of
``remoe.model.losses``.

Validation / test loss overall and per domain:

``evaluate_loss`` takes evaluation batches ``(input_ids [B, S+1], domain_ids [B])`` (as
:meth:`remoe.data.DataBundle.eval_batches` yields them), predicts tokens ``1..S`` of each row
from the tokens before them, and returns the token-weighted mean cross-entropy: every predicted
token counts once, so a domain's loss is the mean over its tokens and the overall loss is the
mean over all tokens (not the mean of the domain means).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from remoe.model.losses import effective_experts_of
from remoe.model.losses import layer_sparsity_of, sparsity_of


def _ppl(loss: float) -> float:
    if math.isnan(loss):
        return float("nan")
    return math.exp(loss) if loss < 700 else float("inf")


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches: Iterable[Any], domain_names: list[str],
                  device: str | torch.device | None = None,
                  max_batches: int | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy of ``model`` on ``batches``, overall and per domain.

    ``batches`` yields ``(input_ids [B, S+1], domain_ids [B])`` pairs (tuples or
    :class:`remoe.data.Batch`); ``domain_ids`` index ``domain_names``. ``device`` defaults to
    the model's. The model runs in eval mode under ``no_grad``; its train/eval mode is restored
    afterwards. Returns ``{"loss", "ppl", "tokens", "domains": {name: {"loss", "ppl",
    "tokens"}}}``; ``domains`` lists only the domains that had tokens, in ``domain_names``
    order; with no tokens at all ``loss`` and ``ppl`` are NaN.
    """
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    num_domains = len(domain_names)
    # float64 sums on the device; read back once at the end (no host sync per batch)
    sums = torch.zeros(num_domains, dtype=torch.float64, device=device)
    counts = torch.zeros(num_domains, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            input_ids, domain_ids = batch[0], batch[1]
            input_ids = torch.as_tensor(input_ids, device=device).long()
            domain_ids = torch.as_tensor(domain_ids, device=device).long().reshape(-1)
            if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
                continue
            if input_ids.shape[0] != domain_ids.shape[0]:
                raise ValueError(f"batch {i}: {input_ids.shape[0]} rows but "
                                 f"{domain_ids.shape[0]} domain ids")
            logits = model(input_ids=input_ids[:, :-1]).logits
            targets = input_ids[:, 1:]
            nll_BS = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                     targets.reshape(-1), reduction="none").view(targets.shape)
            sums.index_add_(0, domain_ids, nll_BS.double().sum(1))
            counts.index_add_(0, domain_ids, torch.full(domain_ids.shape, float(targets.shape[1]),
                                                         dtype=torch.float64, device=device))
    finally:
        model.train(was_training)

    sums_l, counts_l = sums.tolist(), counts.tolist()
    total_tokens = sum(counts_l)
    loss = sum(sums_l) / total_tokens if total_tokens else float("nan")
    domains = {}
    for name, s, n in zip(domain_names, sums_l, counts_l):
        if n > 0:
            domains[name] = {"loss": s / n, "ppl": _ppl(s / n), "tokens": int(n)}
    return {"loss": loss, "ppl": _ppl(loss), "tokens": int(total_tokens), "domains": domains}


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
