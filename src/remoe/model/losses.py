"""What a forward reduces to, apart from the model: the routing statistics (the sparsity S of
paper eq. 7, overall and per MoE layer; how many of its experts a layer uses) and the causal LM
loss (whole, compiled or over chunks of tokens), and the held-out loss per domain.

How many experts a layer uses, from the tokens routed to each expert (``counts_LN``: the counts
a training step reduces once, ``metrics.jsonl`` ``expert_counts``): experts per token
``sum_e c_{l,e} / T``; effective experts ``exp(H(p_l))`` with ``p_l = c_l / sum_e c_{l,e}`` the
layer's load distribution (natural log, 0 log 0 = 0): N for a perfectly balanced layer, 1 when
one expert takes every pair, 0 for a layer that routed nothing. From the routing masks
(``masks_LTN``, bool ``[L, T, N]``: a calibration pass), which the counts cannot give: the
share of tokens routed to no expert in each layer.

``evaluate_loss`` takes evaluation batches ``(input_ids [B, S+1], domain_ids [B])`` (as
``remoe.data.DataBundle.eval_batches`` yields them), predicts tokens ``1..S`` of each row
from the tokens before them, and returns the token-weighted mean cross-entropy: every predicted
token counts once, so a domain's loss is the mean over its tokens and the overall loss is the
mean over all tokens (not the mean of the domain means).

Legend: B batch, S positions, T tokens, D model width, V vocabulary, L MoE layers, N experts
(E*G).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor


# the one definition of the sparsity (also of a training step's:
# remoe.method.sparsity.step_statistics)
def sparsity_of(counts_LN: Tensor, num_tokens: float) -> Tensor:
    """S = 1 - active pairs / (L * T * N) (paper eq. 7), a 0-d tensor; 0 without MoE layers."""
    L, N = counts_LN.shape
    if L == 0:
        return counts_LN.new_zeros(())
    return 1.0 - counts_LN.sum() / max(L * num_tokens * N, 1)


def layer_sparsity_of(counts_LN: Tensor, num_tokens: float) -> Tensor:
    """[L]: 1 - active pairs / (T * N) of each MoE layer (every layer sees every token)."""
    N = counts_LN.shape[1]
    return 1.0 - counts_LN.sum(1) / max(num_tokens * N, 1)


def effective_experts_of(counts_LN: Tensor) -> Tensor:
    """[L] float64 exp(entropy) of each layer's load ``counts_LN / counts_LN.sum(1)``."""
    c_LN = counts_LN.detach().to(torch.float64)
    total_L1 = c_LN.sum(1, keepdim=True)
    p_LN = c_LN / total_L1.clamp_min(1e-300)
    ent_L = -torch.where(p_LN > 0, p_LN * p_LN.clamp_min(1e-300).log(), 0.0).sum(1)
    return torch.where(total_L1[:, 0] > 0, ent_L.exp(), 0.0)


def no_expert_share_of(masks_LTN: np.ndarray) -> np.ndarray:
    """[L] float64 share of the T tokens with no active expert in each layer (NaN if T = 0)."""
    m_LTN = np.asarray(masks_LTN, dtype=bool)
    if m_LTN.shape[1] == 0:
        return np.full(m_LTN.shape[0], np.nan)
    return (~m_LTN.any(axis=2)).mean(axis=1, dtype=np.float64)


def _lm_loss_sum(h_TD: Tensor, weight_VD: Tensor, labels_T: Tensor) -> Tensor:
    return F.cross_entropy(F.linear(h_TD, weight_VD).float(), labels_T, ignore_index=-100,
                           reduction="sum")


def next_token_loss(logits_BSV: Tensor, labels_BS: Tensor,
                    num_items: Tensor | int | None = None) -> Tensor:
    """The causal LM loss of ``logits_BSV``: fp32 cross-entropy of every position but the last
    against the next label (-100 ignored); the mean, or the sum over ``num_items`` (the
    predicted tokens of a whole accumulated batch, as transformers' Trainer asks)."""
    V = logits_BSV.shape[-1]
    logits_TV, y_T = logits_BSV[:, :-1].reshape(-1, V).float(), labels_BS[:, 1:].reshape(-1)
    if num_items is None:
        return F.cross_entropy(logits_TV, y_T, ignore_index=-100)
    return F.cross_entropy(logits_TV, y_T, ignore_index=-100, reduction="sum") / num_items


def lm_loss(h_BSD: Tensor, weight_VD: Tensor, labels_BS: Tensor,
            num_items: Tensor | int | None = None) -> Tensor:
    """:func:`next_token_loss` of the LM head's logits of the final hidden states ``h_BSD``:
    what ``train.compile_loss`` compiles as one function (``ReMoEForCausalLM.compile_lm_loss``;
    inductor fuses the upcast, the softmax and the gather, forward and backward)."""
    return next_token_loss(F.linear(h_BSD, weight_VD), labels_BS, num_items)


def chunked_lm_loss(h_BSD: Tensor, weight_VD: Tensor, labels_BS: Tensor, chunk: int,
                    num_items: Tensor | int | None = None) -> Tensor:
    """The causal LM loss of the final hidden states ``h_BSD`` under the LM head ``weight_VD``,
    ``chunk`` tokens at a time: each chunk's logits are made, reduced to their loss sum and
    dropped, and made again in backward (activation checkpointing), so the ``[T, V]`` fp32
    logits never exist at once. The mean over the labels that are not -100 (or the sum over
    ``num_items``, as transformers' Trainer asks); equal to the unchunked loss up to the order
    of the sum."""
    D = h_BSD.shape[-1]
    h_TD = h_BSD[:, :-1].reshape(-1, D)
    y_T = labels_BS[:, 1:].reshape(-1)
    total = h_TD.new_zeros((), dtype=torch.float32)
    for i in range(0, h_TD.shape[0], chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            _lm_loss_sum, h_TD[i:i + chunk], weight_VD, y_T[i:i + chunk], use_reentrant=False)
    if num_items is not None:
        return total / num_items
    return total / (y_T != -100).sum().clamp(min=1)


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
