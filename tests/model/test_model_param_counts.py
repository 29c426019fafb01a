"""Preset parameter counts against the paper (Table 1 and §4.3), built on the meta device."""

from __future__ import annotations

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM


def _build(preset: str, **kw) -> ReMoEForCausalLM:
    with torch.device("meta"):
        return ReMoEForCausalLM(ReMoEConfig.from_preset(preset, **kw))


@pytest.mark.parametrize("preset, dense_params, moe_params", [
    ("small", 182e6, 777e6),
    ("medium", 469e6, 2.58e9),
    ("large", 978e6, 5.73e9),
])
def test_paper_parameter_counts(preset, dense_params, moe_params):
    dense = _build(preset, router="dense")
    moe = _build(preset, router="relu", num_experts=8, top_k=1)
    assert dense.config.vocab_size == 50304
    assert dense.num_parameters() == pytest.approx(dense_params, rel=0.01)
    assert moe.num_parameters() == pytest.approx(moe_params, rel=0.01)
    # active parameters of E=8, k=1: the dense model plus one [E, D] router per layer
    c = moe.config
    router_params = c.backbone.num_layers * c.routing.num_experts * c.hidden_size
    assert moe.num_parameters(active=True) == dense.num_parameters() + router_params
    assert dense.num_parameters(active=True) == dense.num_parameters()


def test_active_parameters_with_granularity_and_k():
    dense = _build("small", router="dense")
    c = dense.config
    fine = _build("small", router="topk", num_experts=8, top_k=1, granularity=4)
    # k*G = 4 experts of width d_ffn/4: the same active FFN width as dense; router has E*G rows
    assert fine.num_parameters(active=True) == (dense.num_parameters()
                                                + c.backbone.num_layers * 32 * c.hidden_size)
    k2 = _build("small", router="relu", num_experts=8, top_k=2)
    ffn = 3 * c.hidden_size * c.backbone.ffn_hidden_size
    assert k2.num_parameters(active=True) == (dense.num_parameters() + c.backbone.num_layers * ffn
                                              + c.backbone.num_layers * 8 * c.hidden_size)
    wide = _build("small", router="dense_wide", num_experts=8)
    assert wide.num_parameters() == dense.num_parameters() + c.backbone.num_layers * 7 * ffn
