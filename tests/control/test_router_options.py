"""ReLU router options: gate threshold (inference dial), cap on active experts, revival hinge."""

from __future__ import annotations

import torch

from remoe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext
from remoe.model.routers.relu import ReLURouter, revival_hinge


def _layer(**kw):
    torch.manual_seed(0)
    return MoELayer(MoEConfig.build(d_model=16, d_ffn=32, num_experts=8, top_k=1, **kw))


def test_threshold_zero_is_exactly_the_relu_router_and_positive_tau_prunes_at_inference():
    x = torch.randn(2, 12, 16)
    plain, tau0, tau = _layer(), _layer(gate_threshold=0.0), _layer(gate_threshold=0.02)
    for m in (plain, tau0, tau):
        m.eval()
    y0, a0 = plain(x)
    y1, a1 = tau0(x)
    assert torch.equal(y0, y1) and torch.equal(a0.active_counts_N, a1.active_counts_N)
    y2, a2 = tau(x)
    assert a2.active_counts_N.sum() < a0.active_counts_N.sum()
    tau.train()  # training never applies the dial
    _, a3 = tau(x)
    assert torch.equal(a3.active_counts_N, a0.active_counts_N)


def test_max_active_caps_experts_per_token_keeping_the_largest_gates():
    r = ReLURouter(16, 8, 1 / 8, max_active=2)
    torch.nn.init.normal_(r.weight, std=1.0)
    x = torch.randn(50, 16)
    out = r(x, RouterContext(1, 50))
    assert int(out.mask_TN.sum(1).max()) <= 2
    full = torch.relu(x @ r.weight.t())
    top2 = full.topk(2, dim=-1).values
    kept = out.gates_TN.sort(dim=-1, descending=True).values[:, :2]
    assert torch.allclose(kept, top2)


def test_revival_hinge_moves_only_dead_experts_rows_towards_their_nearest_tokens():
    torch.manual_seed(0)
    r = ReLURouter(16, 4, 0.25)
    x = torch.randn(40, 16)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():  # expert 2 dead: negative logit for every token
        r.weight[2] = 0.0
        r.weight[2, 0] = -1.0
    assert (x @ r.weight[2] < 0).all()
    out = r(x, RouterContext(1, 40, revive_N=torch.tensor([False, False, True, False])))
    assert out.aux_loss > 0
    out.aux_loss.backward()
    g = r.weight.grad
    assert g[2].abs().sum() > 0 and g[[0, 1, 3]].abs().sum() == 0
    assert r(x, RouterContext(1, 40)).aux_loss == 0  # only for the forwards given revive_N
    r.eval()  # no hinge at inference
    assert r(x, RouterContext(1, 40, revive_N=torch.tensor([False, False, True, False]))
             ).aux_loss == 0


def test_revival_hinge_value_by_hand():
    z = torch.tensor([[-1.0, 3.0], [-0.5, 1.0], [-4.0, 2.0], [-2.0, 0.0]])
    # density 0.5 of 4 tokens -> the 2 largest logits of the dead expert 0: -0.5, -1 -> mean 0.75
    assert revival_hinge(z, torch.tensor([True, False]), 0.5).item() == 0.75
