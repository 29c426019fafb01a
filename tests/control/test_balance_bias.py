"""``model.balance_bias_rate``: the ReLU router's per-expert balancing offset."""

from __future__ import annotations

import pytest
import torch

from remoe.errors import ConfigError
from remoe.model.routers import RouterContext
from remoe.model.routers.relu import ReLURouter
from remoe.model.spec import ModelSpec


def test_offset_moves_by_the_centred_sign_step_and_enters_the_gates():
    r = ReLURouter(2, 4, 1 / 4, balance_bias_rate=0.1)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]))
    # loads 3, 1, 0, 4 (mean 2): under-loaded experts 1 and 2 go up, 0 and 3 down; the steps
    # sum to 0, so nothing is subtracted
    r.after_step(torch.tensor([3.0, 1.0, 0.0, 4.0]))
    assert r.expert_bias_N.tolist() == pytest.approx([-0.1, 0.1, 0.1, -0.1])
    # loads 2, 2, 1, 3: experts 0 and 1 sit at the mean (no step); +0.1 and -0.1 sum to 0
    r.after_step(torch.tensor([2.0, 2.0, 1.0, 3.0]))
    assert r.expert_bias_N.tolist() == pytest.approx([-0.1, 0.1, 0.2, -0.2])
    # loads 0, 4, 4, 4 (mean 3): +0.1, -0.1, -0.1, -0.1 has mean -0.05, which is removed
    r.after_step(torch.tensor([0.0, 4.0, 4.0, 4.0]))
    assert r.expert_bias_N.tolist() == pytest.approx([0.05, 0.05, 0.15, -0.25])
    x = torch.tensor([[0.5, -0.1], [-0.1, 0.2]])
    out = r(x, RouterContext(1, 2))
    # logits x W^T: [0.5, -0.1, -0.5, 0.1] and [-0.1, 0.2, 0.1, -0.2], plus the offsets
    want = torch.relu(torch.tensor([[0.55, -0.05, -0.35, -0.15], [-0.05, 0.25, 0.25, -0.45]]))
    assert torch.allclose(out.gates_TN, want)
    assert out.mask_TN.tolist() == [[True, False, False, False], [False, True, True, False]]


def test_a_starving_expert_comes_back_without_any_gradient():
    torch.manual_seed(0)
    r = ReLURouter(8, 4, 1 / 4, balance_bias_rate=0.05)
    with torch.no_grad():
        r.weight[:3] = 1.0  # experts 0-2 serve every token (logits 1-7)
        r.weight[3] = -r.weight[3].abs() - 1.0  # expert 3: negative for every positive input
    x = torch.rand(64, 8)
    steps = 0
    while r(x, RouterContext(1, 64)).mask_TN[:, 3].sum() == 0:
        r.after_step(r(x, RouterContext(1, 64)).mask_TN.sum(0).float())
        steps += 1
        assert steps < 200
    # each step: +rate for expert 3, -rate for the three busy ones, centred: +0.075 / -0.025
    assert steps > 10
    assert r.expert_bias_N.tolist() == pytest.approx([-0.025 * steps] * 3 + [0.075 * steps])


def test_off_by_default_leaves_the_papers_router_and_state_dict():
    r = ReLURouter(4, 4, 1 / 4)
    assert list(r.state_dict()) == ["weight"]
    w = r.weight.detach().clone()
    r.after_step(torch.tensor([4.0, 0.0, 0.0, 0.0]))  # a no-op
    assert torch.equal(r.weight, w) and not hasattr(r, "expert_bias_N")


@pytest.mark.parametrize("fields, words", [
    ({"balance_bias_rate": -0.001}, "model.balance_bias_rate=-0.001"),
    ({"balance_bias_rate": -0.001, "router": "topk"}, "model.balance_bias_rate=-0.001"),
])
def test_bad_rates_are_one_line_errors_naming_the_field(fields, words):
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_flat({"preset": "micro", **fields}).validate()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_rate_is_the_relu_routers_option():
    """Another router's config leaves it out (checked, as every built-in option)."""
    spec = ModelSpec.from_flat({"preset": "micro", "router": "topk", "balance_bias_rate": 0.001})
    assert not hasattr(spec.routing.options, "balance_bias_rate")
