"""SparseMixer-v2 (GRIN): the router weights receive GRIN's estimated gradient.

The router weight is the identity (D == N), so the logits are the token states and the
hand-derived gradient of ``L = sum_t c_t . gates_t`` w.r.t. W is ``dz^T x`` with, per pick D,
``dz = c_D pi_D (e_D - pi)`` where ``pi`` is the softmax over the experts inside the jitter window
``(m - z_i) / max(|z_i|, m) <= 2 eps`` -- with the *unscaled* ``pi_D`` even when the forward gate
was scaled by 1/3 (GRIN's midpoint rule).
"""

from __future__ import annotations

import pytest
import torch

from remoe import ReMoEConfig
from remoe.model.moe import MoEConfig
from remoe.model.routers import RouterContext, build_router, switch_load_balancing_loss
from remoe.model.routers.sparsemixer import SparseMixerRouter
from remoe.model.routers.topk import TopKRouter

EPS = 0.1  # window: within 20% (relative) of the best remaining logit
ROWS = torch.tensor([[1.0, 0.9, 0.85, 0.2],  # window {0, 1, 2}
                     [-0.5, -0.55, 0.3, 0.29],  # window {2, 3}
                     [0.2, 0.6, 0.59, 0.61],  # window {1, 2, 3}
                     [2.0, -1.0, 0.5, 1.0]])  # window {0}: no routing gradient at all
WINDOWS = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)


def _identity(router):
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router


def _window(z: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """The hand formula of the eligible set (row by row, in plain Python floats)."""
    out = torch.zeros_like(taken)
    for t in range(z.shape[0]):
        m = max(float(z[t, i]) for i in range(z.shape[1]) if not taken[t, i])
        for i in range(z.shape[1]):
            zi = float(z[t, i])
            out[t, i] = (not taken[t, i]) and (m - zi) / max(abs(zi), m) <= 2 * EPS
    return out


def _masked_softmax(z: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z.masked_fill(~ok, float("-inf")), dim=-1)


def _grad_W(router, x, c):
    router.weight.grad = None
    r = router(x, RouterContext(batch_size=1, seq_len=x.shape[0], step=0))
    (r.gates_TN * c).sum().backward()
    return r, router.weight.grad.clone()


def test_hand_windows():
    assert torch.equal(_window(ROWS, torch.zeros_like(WINDOWS)), WINDOWS)


def test_training_gradient_is_grins_estimator():
    x = ROWS.repeat(16, 1)
    c = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    sm = _identity(SparseMixerRouter(4, 4, k=1, lb_coeff=0.0, jitter_eps=EPS)).train()
    torch.manual_seed(0)
    r, grad = _grad_W(sm, x, c)

    window = WINDOWS.repeat(16, 1)
    pi = _masked_softmax(x, window)
    D = r.mask_TN.float().argmax(1)
    assert (r.mask_TN.sum(1) == 1).all() and (r.mask_TN <= window).all()  # sampled in the window
    pi_D = pi.gather(1, D[:, None]).squeeze(1)
    gate = r.gates_TN.gather(1, D[:, None]).squeeze(1).detach()
    scaled = ~torch.isclose(gate, pi_D)
    torch.testing.assert_close(gate[scaled], pi_D[scaled] / 3)
    non_argmax = D != pi.argmax(1)
    assert non_argmax.any() and scaled.any() and (scaled <= non_argmax).all()

    g = c.gather(1, D[:, None])
    dz = g * pi_D[:, None] * (torch.nn.functional.one_hot(D, 4) - pi)
    torch.testing.assert_close(grad, dz.t() @ x, atol=1e-6, rtol=1e-5)
    assert grad.abs().sum() > 0
    # ... which is not what plain autograd of the forward value would give (it carries the 1/3)
    s = torch.where(scaled, 1 / 3, 1.0)[:, None]
    assert not torch.allclose(grad, (dz * s).t() @ x, atol=1e-4)
    # ... nor the straight TopK gradient through the full softmax on the same weights and loss
    topk = _identity(TopKRouter(4, 4, k=1, lb_coeff=0.0))
    _, grad_topk = _grad_W(topk, x, c)
    assert not torch.allclose(grad, grad_topk, atol=1e-3)


def test_eval_top2_picks_sequentially_with_hand_gradient():
    x = ROWS
    c = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    sm = _identity(SparseMixerRouter(4, 4, k=2, lb_coeff=0.0, jitter_eps=EPS)).eval()
    r, grad = _grad_W(sm, x, c)
    top2 = x.topk(2, dim=-1).indices
    assert torch.equal(r.mask_TN, torch.zeros_like(r.mask_TN).scatter(1, top2, True))
    dz = torch.zeros_like(x)
    taken = torch.zeros_like(r.mask_TN)
    for j in range(2):
        D = top2[:, j]
        pi = _masked_softmax(x, _window(x, taken))
        pi_D = pi.gather(1, D[:, None])
        torch.testing.assert_close(r.gates_TN.gather(1, D[:, None]).detach(), pi_D)
        dz += c.gather(1, D[:, None]) * pi_D * (torch.nn.functional.one_hot(D, 4) - pi)
        taken = taken.scatter(1, D[:, None], True)
    torch.testing.assert_close(grad, dz.t() @ x, atol=1e-6, rtol=1e-5)


def test_jitter_default_and_load_balancing_loss():
    assert ReMoEConfig(router="sparsemixer").routing.options.sparsemixer_jitter == 0.01  # GRIN
    cfg = MoEConfig.build(d_model=8, d_ffn=16, num_experts=4, top_k=1, router="sparsemixer")
    router = build_router(cfg).eval()
    assert router.jitter_eps == 0.01 and router.lb_coeff == 0.01
    x = torch.randn(32, 8)
    r = router(x, RouterContext(1, 32))
    probs = torch.softmax(x @ router.weight.t(), dim=-1)
    torch.testing.assert_close(r.aux_loss, 0.01 * switch_load_balancing_loss(probs, r.mask_TN))
    # at inference the pick is the arg-max: the same experts as TopK
    assert torch.equal(r.mask_TN.float().argmax(1), probs.argmax(1))


@pytest.mark.parametrize("k", [1, 3])
def test_training_picks_k_distinct_experts(k):
    torch.manual_seed(0)
    router = SparseMixerRouter(8, 8, k=k, jitter_eps=0.5, init_std=1.0).train()
    r = router(torch.randn(64, 8), RouterContext(1, 64, step=0))
    assert (r.mask_TN.sum(1) == k).all()
    assert ((r.gates_TN > 0) == r.mask_TN).all() and (r.gates_TN <= 1).all()
