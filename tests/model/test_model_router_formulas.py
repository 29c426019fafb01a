"""Routing formulas against hand-computed values on tiny tensors (paper eq. 7-9, Switch LB)."""

from __future__ import annotations

import pytest
import torch

from remoe.model.llama import MoEAux
from remoe.model.moe import MoEConfig
from remoe.model.routers import (RouterContext, build_router, l1_regularizer,
                                 switch_load_balancing_loss)
from remoe.model.routers.relu import ReLURouter
from remoe.model.routers.topk import TopKRouter

# T=4 tokens, N=4 experts. Column counts of active entries: [3, 1, 1, 1]; token 2 routes nowhere.
R_HAND = torch.tensor([[0.5, 0.0, 0.0, 0.2],
                       [0.3, 0.1, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0],
                       [0.4, 0.0, 0.6, 0.0]], dtype=torch.float64)


def _ctx(T: int, step: int | None = None) -> RouterContext:
    return RouterContext(batch_size=1, seq_len=T, step=step)


def _identity_router(router, N: int) -> None:
    """D == N and W = I, so the router logits are the token states themselves."""
    with torch.no_grad():
        router.weight.copy_(torch.eye(N))


# ---------------------------------------------------------------- L1 / load-balanced L1


@pytest.mark.parametrize("k, expected", [
    # f_e = E/(k T) * count_e = count_e (E=4, k=1, T=4):  (3*1.2 + 0.1 + 0.6 + 0.2) / 4
    (1, 1.125),
    # k=2 halves f:                                      (1.5*1.2 + 0.5*0.9) / 4
    (2, 0.5625),
])
def test_lb_l1_regularizer_hand_values(k, expected):
    reg = l1_regularizer(R_HAND, R_HAND > 0, target_density=k / 4, load_balance=True)
    assert reg.item() == pytest.approx(expected, rel=1e-12)


def test_plain_l1_regularizer_hand_value():
    # sum of all router outputs / T = 2.1 / 4; independent of k
    for density in (0.25, 0.5):
        reg = l1_regularizer(R_HAND, R_HAND > 0, target_density=density, load_balance=False)
        assert reg.item() == pytest.approx(0.525, rel=1e-12)


@pytest.mark.parametrize("load_balance", [True, False])
def test_regularizer_gradient_per_active_gate(load_balance):
    """d L / d z_te = f_e / T for active entries (f = 1 for plain L1), exactly 0 for inactive ones.

    z are the pre-ReLU logits, so the gate ReLU(z) is what the router hands to the loss. An
    over-used expert (column 0, f=3) is pushed towards zero 3x harder than the others.
    """
    z = torch.tensor([[0.5, -0.1, -0.3, 0.2],
                      [0.3, 0.1, -0.2, -0.5],
                      [-0.1, -0.2, -0.3, -0.4],
                      [0.4, -0.7, 0.6, -0.1]], dtype=torch.float64, requires_grad=True)
    gates = torch.relu(z)
    T = 4
    l1_regularizer(gates, gates > 0, target_density=0.25, load_balance=load_balance).backward()
    f = torch.tensor([3.0, 1.0, 1.0, 1.0], dtype=torch.float64) if load_balance else torch.ones(4, dtype=torch.float64)
    expected = (z.detach() > 0).double() * f / T
    assert torch.equal(z.grad, expected)
    if load_balance:
        active = z.detach() > 0
        assert z.grad[active[:, 0], 0].min() > z.grad[:, 1:][active[:, 1:]].max()


def test_f_carries_no_gradient_even_when_mask_is_derived_from_gates():
    # If f were differentiable, the gradient would not be exactly f_e / T.
    z = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    gates = torch.relu(z)
    l1_regularizer(gates, gates > 0, target_density=0.5).backward()
    # E/(kT) = 2/(1*2) = 1 -> f = counts = [2, 1]; grad = f / T
    assert torch.equal(z.grad, torch.tensor([[1.0, 0.5], [1.0, 0.0]], dtype=torch.float64))


def test_relu_router_end_to_end_with_granularity():
    """E=2, G=2 (N=4 routed experts), k=1: target density kG/(EG) = 1/2 -> f_e = count_e / 2."""
    cfg = MoEConfig.build(d_model=4, d_ffn=8, num_experts=2, top_k=1, granularity=2, router="relu")
    router = build_router(cfg)
    assert isinstance(router, ReLURouter) and router.uses_adaptive_reg
    _identity_router(router, 4)
    x = torch.tensor([[0.5, -1.0, -2.0, 0.2],
                      [0.3, 0.1, -0.5, -0.1],
                      [-1.0, -1.0, -1.0, -1.0],
                      [0.4, -0.3, 0.6, -0.2]])
    r = router(x, _ctx(4))
    assert torch.equal(r.gates_TN, torch.relu(x))
    assert torch.equal(r.mask_TN, x > 0)
    assert r.gates_TN.dtype == torch.float32
    # sum_e f_e sum_t R_te / T with f = [3, 1, 1, 1] / 2
    assert r.reg_loss.item() == pytest.approx((1.5 * 1.2 + 0.5 * 0.1 + 0.5 * 0.6 + 0.5 * 0.2) / 4, rel=1e-6)
    assert r.aux_loss.item() == 0.0

    plain = build_router(MoEConfig.build(d_model=4, d_ffn=8, num_experts=2, top_k=1, granularity=2,
                                   router="relu", reg_type="l1"))
    _identity_router(plain, 4)
    assert plain(x, _ctx(4)).reg_loss.item() == pytest.approx(2.1 / 4, rel=1e-6)


def test_relu_token_may_activate_zero_to_all_experts():
    router = ReLURouter(3, 3, target_density=1 / 3)
    _identity_router(router, 3)
    x = torch.tensor([[-1.0, -2.0, -3.0], [1.0, 2.0, 3.0], [1.0, -1.0, 0.0]])
    r = router(x, _ctx(3))
    assert r.mask_TN.sum(1).tolist() == [0, 3, 1]
    # gates are exactly zero where inactive (ReLU(0) counts as inactive)
    assert torch.equal(r.gates_TN[~r.mask_TN], torch.zeros(5))


# ---------------------------------------------------------------- sparsity S


def test_sparsity_against_hand_count():
    # L=2 MoE layers, T=3 tokens, N=4 experts: 6 + 3 = 9 active pairs of 24
    counts = torch.tensor([[3.0, 0.0, 1.0, 2.0], [1.0, 1.0, 1.0, 0.0]])
    aux = MoEAux(torch.zeros(()), torch.zeros(()), counts, num_tokens=3)
    assert aux.num_moe_layers == 2
    assert aux.sparsity.item() == pytest.approx(1 - 9 / 24)
    assert aux.layer_sparsity.tolist() == pytest.approx([1 - 6 / 12, 1 - 3 / 12])


def test_sparsity_without_moe_layers_is_zero():
    aux = MoEAux(torch.zeros(()), torch.zeros(()), torch.zeros(0, 0), num_tokens=5)
    assert aux.sparsity.item() == 0.0
    assert aux.layer_sparsity.numel() == 0


# ---------------------------------------------------------------- TopK / Switch LB


def test_switch_lb_is_one_for_perfect_balance_uniform_probs():
    T = N = 4
    probs = torch.full((T, N), 1 / N)
    mask = torch.eye(N, dtype=torch.bool)  # one token per expert
    assert switch_load_balancing_loss(probs, mask).item() == pytest.approx(1.0, rel=1e-6)
    # k = 2 balanced: every expert gets 2 of the 8 pairs
    mask2 = mask | mask.roll(1, dims=1)
    assert switch_load_balancing_loss(probs, mask2).item() == pytest.approx(1.0, rel=1e-6)


def test_switch_lb_hand_value_and_gradient():
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1],
                          [0.6, 0.2, 0.1, 0.1],
                          [0.1, 0.1, 0.1, 0.7],
                          [0.1, 0.4, 0.3, 0.2]], dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[[0, 1, 2, 3], [0, 0, 3, 1]] = True
    loss = switch_load_balancing_loss(probs, mask)
    # f = [2, 1, 0, 1]/4, P = [0.375, 0.2, 0.15, 0.275]: 4 * (0.1875 + 0.05 + 0 + 0.06875)
    assert loss.item() == pytest.approx(1.225, rel=1e-12)
    loss.backward()
    # f carries no gradient: d loss / d p_te = N f_e / T
    f = torch.tensor([0.5, 0.25, 0.0, 0.25], dtype=torch.float64)
    assert torch.allclose(probs.grad, (4 * f / 4).expand(4, 4), rtol=0, atol=1e-15)


@pytest.mark.parametrize("E, k, G", [(4, 1, 1), (4, 2, 1), (4, 1, 4), (8, 2, 2)])
def test_topk_router_gates_are_unrenormalised_top_probs(E, k, G):
    torch.manual_seed(E * 100 + k * 10 + G)
    cfg = MoEConfig.build(d_model=8, d_ffn=16, num_experts=E, top_k=k, granularity=G, router="topk",
                    init_std=1.0)
    router = build_router(cfg)
    assert isinstance(router, TopKRouter) and not router.uses_adaptive_reg
    N = E * G
    x = torch.randn(6, 8)
    r = router(x, _ctx(6))
    probs = torch.softmax(x @ router.weight.detach().t(), dim=-1)
    assert torch.equal(r.mask_TN.sum(1), torch.full((6,), k * G))
    # the mask keeps the k*G largest probabilities of each token
    kth = probs.sort(dim=-1, descending=True).values[:, k * G - 1 : k * G]
    assert torch.equal(r.mask_TN, probs >= kth)
    torch.testing.assert_close(r.gates_TN, probs * r.mask_TN, rtol=1e-6, atol=1e-7)
    if k * G < N:  # not renormalised: active gates sum to less than 1
        assert (r.gates_TN.sum(1) < 1 - 1e-6).all()
    assert r.reg_loss.item() == 0.0
    torch.testing.assert_close(r.aux_loss, 0.01 * switch_load_balancing_loss(probs, r.mask_TN),
                               rtol=1e-6, atol=1e-8)


def test_topk_router_hand_case():
    router = TopKRouter(4, 4, k=1, lb_coeff=0.01)
    _identity_router(router, 4)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1],
                          [0.6, 0.2, 0.1, 0.1],
                          [0.1, 0.1, 0.1, 0.7],
                          [0.1, 0.4, 0.3, 0.2]])
    r = router(probs.log(), _ctx(4))  # softmax(log p) = p
    expected_mask = torch.zeros(4, 4, dtype=torch.bool)
    expected_mask[[0, 1, 2, 3], [0, 0, 3, 1]] = True
    assert torch.equal(r.mask_TN, expected_mask)
    torch.testing.assert_close(r.gates_TN, probs * expected_mask)
    assert r.aux_loss.item() == pytest.approx(0.01 * 1.225, rel=1e-5)
    assert TopKRouter(4, 4, k=1, lb_coeff=0.0)(probs.log(), _ctx(4)).aux_loss.item() == 0.0


def test_topk_warmup_schedule():
    cfg = MoEConfig.build(d_model=8, d_ffn=16, num_experts=4, top_k=1, granularity=2,
                    router="topk_warmup", warmup_k=3, warmup_steps=5)
    router = build_router(cfg)
    x = torch.randn(5, 8)
    assert (router(x, _ctx(5, step=0)).mask_TN.sum(1) == 6).all()
    assert (router(x, _ctx(5, step=4)).mask_TN.sum(1) == 6).all()
    assert (router(x, _ctx(5, step=5)).mask_TN.sum(1) == 2).all()
    assert (router(x, _ctx(5, step=None)).mask_TN.sum(1) == 2).all()  # inference


def test_router_logits_are_fp32_under_autocast():
    router = ReLURouter(8, 4, target_density=0.25, init_std=1.0)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.logits(x.bfloat16())
        r = router(x, _ctx(3))
    assert logits.dtype == torch.float32
    assert r.gates_TN.dtype == torch.float32 and r.reg_loss.dtype == torch.float32
    torch.testing.assert_close(logits, x.bfloat16().float() @ router.weight.detach().t())
