"""Expert use from a step's counts and from routing masks (remoe.model.losses), and its
place in the step statistics the trainer logs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from remoe.model.losses import effective_experts_of, no_expert_share_of
from remoe.method.sparsity import step_statistics


def test_effective_experts_by_hand():
    counts_LN = torch.tensor([[10.0, 0.0, 5.0, 5.0],  # p = 1/2, 1/4, 1/4: H = 1.5 ln 2
                              [0.0, 0.0, 0.0, 2.0],  # one expert takes all: 1
                              [3.0, 3.0, 3.0, 3.0],  # balanced: N
                              [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # nothing routed: 0
    eff_L = effective_experts_of(counts_LN)
    assert eff_L.dtype == torch.float64
    assert eff_L.tolist() == pytest.approx([2 ** 1.5, 1.0, 4.0, 0.0], rel=1e-12)
    assert effective_experts_of(torch.zeros(0, 4)).tolist() == []


def test_step_statistics_carry_expert_use_per_layer():
    counts_LN = torch.tensor([[10.0, 0.0, 5.0, 5.0], [0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    st = step_statistics(counts_LN, 10.0)
    assert st.layer_active_k == [2.0, 0.2]
    assert st.effective_experts == pytest.approx([2 ** 1.5, 1.0], rel=1e-12)
    assert st.dead_experts == [1, 3]  # the never-firing experts
    empty = step_statistics(torch.zeros(0, 4, dtype=torch.float64), 10.0)
    assert (empty.layer_active_k, empty.effective_experts) == ([], [])


def test_no_expert_share_counts_tokens_without_any_active_expert():
    m_LTN = np.zeros((2, 4, 3), dtype=bool)
    m_LTN[0, 0, 1] = m_LTN[0, 1, :] = True  # layer 0: tokens 2, 3 have no expert
    m_LTN[1, :, 2] = True  # layer 1: every token has one
    assert no_expert_share_of(m_LTN).tolist() == [0.5, 0.0]
    assert math.isnan(no_expert_share_of(np.zeros((1, 0, 3), dtype=bool))[0])
