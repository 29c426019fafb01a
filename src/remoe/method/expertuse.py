"""How many of its experts a MoE layer uses, from what a step or a calibration pass already has.

From the tokens routed to each expert (``counts_LN``: the counts a training step reduces once,
``metrics.jsonl`` ``expert_counts``):

* experts per token of layer l: ``sum_e c_{l,e} / T`` (the layer's ``active_k``);
* effective experts: ``exp(H(p_l))`` with ``p_l = c_l / sum_e c_{l,e}`` the layer's load
  distribution (natural log, 0 log 0 = 0): N for a perfectly balanced layer, 1 when one expert
  takes every pair, 0 for a layer that routed nothing;
* never-firing experts: experts with no token (``dead_experts``).

From the routing masks (``masks_LTN``, bool ``[L, T, N]``: a calibration pass), which the counts
cannot give: the share of tokens routed to no expert in each layer.

Legend: L MoE layers, N experts (E*G), T tokens.
"""

from __future__ import annotations

import numpy as np
import torch


def effective_experts_of(counts_LN: torch.Tensor) -> torch.Tensor:
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
