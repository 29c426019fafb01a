"""MoELayer: grouped_mm == reference == a naive per-token loop, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext


def naive_moe(x_TD: torch.Tensor, gates_TN: torch.Tensor, w_in_ND2H: torch.Tensor,
              w_out_NHD: torch.Tensor) -> torch.Tensor:
    """y_t = sum over active experts e of gate_te * SwiGLU_e(x_t), one token at a time."""
    H = w_out_NHD.shape[1]
    rows = []
    for t in range(x_TD.shape[0]):
        y = torch.zeros_like(x_TD[t])
        for e in range(gates_TN.shape[1]):
            if gates_TN[t, e] != 0:
                h = x_TD[t] @ w_in_ND2H[e]
                y = y + gates_TN[t, e] * ((F.silu(h[:H]) * h[H:]) @ w_out_NHD[e])
        rows.append(y)
    return torch.stack(rows)


def _pair(router: str, E: int, k: int, G: int, D: int = 8, d_ffn: int = 32, seed: int = 0):
    """The same layer twice, once per expert backend."""
    layers = []
    for backend in ("grouped_mm", "reference"):
        torch.manual_seed(seed)
        layers.append(MoELayer(MoEConfig.build(d_model=D, d_ffn=d_ffn, num_experts=E, top_k=k,
                                         granularity=G, router=router, expert_backend=backend,
                                         init_std=0.3)))
    layers[1].load_state_dict(layers[0].state_dict())
    return layers


def _relu_inputs_with_idle_token_and_idle_expert(layer: MoELayer, T: int = 10, seed: int = 1):
    """x [T, D] where token 0 activates no expert and expert 0 receives no token."""
    torch.manual_seed(seed)
    D = layer.cfg.d_model
    x = torch.randn(T, D)
    x[:, 0] = x[:, 0].abs() + 0.5  # every token has a positive first coordinate
    with torch.no_grad():
        W = layer.router.weight
        x0 = x[0]
        for e in range(1, W.shape[0]):  # token 0: logit -1 for every expert
            W[e] -= (W[e] @ x0 + 1.0) * x0 / (x0 @ x0)
        W[0] = 0.0
        W[0, 0] = -10.0  # expert 0: negative logit for every token
    return x


def _grads(layer: MoELayer, x: torch.Tensor, c: torch.Tensor):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    y, aux = layer(x)
    ((y * c).sum() + aux.reg_loss + aux.aux_loss).backward()
    return y.detach(), [x.grad, layer.experts.w_in_ND2H.grad, layer.experts.w_out_NHD.grad,
                        layer.router.weight.grad]


@pytest.mark.parametrize("E, k, G", [(4, 1, 1), (4, 1, 4), (4, 2, 2)])
def test_relu_backends_and_naive_loop_agree(E, k, G):
    gm, ref = _pair("relu", E, k, G)
    x = _relu_inputs_with_idle_token_and_idle_expert(gm)
    ref.load_state_dict(gm.state_dict())
    with torch.no_grad():
        r = gm.router(x, RouterContext(batch_size=1, seq_len=x.shape[0]))
    assert r.mask_TN[0].sum() == 0 and r.mask_TN[:, 0].sum() == 0
    assert r.mask_TN.sum(1).max() > 1  # some token uses several experts
    assert (r.mask_TN.sum(0)[1:] > 0).any()

    c = torch.randn_like(x)
    y_gm, g_gm = _grads(gm, x, c)
    y_ref, g_ref = _grads(ref, x, c)
    y_naive = naive_moe(x, r.gates_TN, gm.experts.w_in_ND2H.detach(), gm.experts.w_out_NHD.detach())

    torch.testing.assert_close(y_gm, y_naive, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_ref, y_naive, rtol=1e-5, atol=1e-6)
    assert torch.equal(y_gm[0], torch.zeros(x.shape[1]))  # exact zeros, not just small
    assert torch.equal(y_ref[0], torch.zeros(x.shape[1]))
    routed = r.mask_TN.any(1)
    assert (y_gm[routed].abs().sum(1) > 0).all()
    assert torch.equal(y_gm[~routed], torch.zeros_like(y_gm[~routed]))
    for a, b in zip(g_gm, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the idle expert gets exactly zero gradient from both backends
    assert torch.equal(g_gm[1][0], torch.zeros_like(g_gm[1][0]))
    assert torch.equal(g_ref[2][0], torch.zeros_like(g_ref[2][0]))


def test_naive_loop_gradients_match_the_layer():
    gm, _ = _pair("relu", 4, 1, 4)
    x = _relu_inputs_with_idle_token_and_idle_expert(gm)
    c = torch.randn_like(x)
    _, g_gm = _grads(gm, x, c)
    xr = x.clone().requires_grad_(True)
    gm.zero_grad()
    ctx = RouterContext(batch_size=1, seq_len=x.shape[0])
    r = gm.router(xr, ctx)
    y = naive_moe(xr, r.gates_TN, gm.experts.w_in_ND2H, gm.experts.w_out_NHD)
    ((y * c).sum() + r.reg_loss).backward()
    naive = [xr.grad, gm.experts.w_in_ND2H.grad, gm.experts.w_out_NHD.grad, gm.router.weight.grad]
    for a, b in zip(g_gm, naive):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E, k, G", [(4, 1, 1), (4, 1, 4), (2, 2, 2)])
def test_topk_backends_and_naive_loop_agree(E, k, G):
    gm, ref = _pair("topk", E, k, G, seed=E + k + G)
    torch.manual_seed(5)
    x = torch.randn(2, 3, 8)  # [B, S, D] keeps its shape
    c = torch.randn_like(x)
    y_gm, g_gm = _grads(gm, x, c)
    y_ref, g_ref = _grads(ref, x, c)
    assert y_gm.shape == x.shape
    with torch.no_grad():
        r = gm.router(x.reshape(-1, 8), RouterContext(batch_size=2, seq_len=3))
    if G * E > 4:
        assert (r.mask_TN.sum(0) == 0).any()  # an expert with zero tokens
    y_naive = naive_moe(x.reshape(-1, 8), r.gates_TN, gm.experts.w_in_ND2H.detach(),
                        gm.experts.w_out_NHD.detach()).view_as(x)
    torch.testing.assert_close(y_gm, y_naive, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_ref, y_naive, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_gm, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_all_tokens_idle_gives_zero_output_and_zero_expert_grads():
    for layer in _pair("relu", 4, 1, 1):
        with torch.no_grad():
            layer.router.weight.zero_()  # every logit is 0 -> ReLU(0) = 0: nothing active
        x = torch.randn(5, 8, requires_grad=True)
        y, aux = layer(x)
        assert torch.equal(y, torch.zeros(5, 8))
        assert aux.active_counts_N.sum() == 0 and aux.num_tokens == 5
        y.sum().backward()
        assert layer.experts.w_in_ND2H.grad is None or layer.experts.w_in_ND2H.grad.abs().sum() == 0


def test_auto_backend_with_unaligned_widths_matches_naive():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig.build(d_model=6, d_ffn=10, num_experts=2, top_k=1, router="relu",
                               expert_backend="auto", init_std=0.5))
    x = torch.randn(7, 6)
    y, aux = layer(x)
    r = layer.router(x, RouterContext(batch_size=1, seq_len=7))
    torch.testing.assert_close(y, naive_moe(x, r.gates_TN, layer.experts.w_in_ND2H,
                                            layer.experts.w_out_NHD), rtol=1e-5, atol=1e-6)


def test_layer_aux_counts_and_masks():
    gm, _ = _pair("relu", 4, 1, 2)
    x = _relu_inputs_with_idle_token_and_idle_expert(gm)
    ctx = RouterContext(batch_size=1, seq_len=x.shape[0], record_masks=True)
    _, aux = gm(x, ctx)
    r = gm.router(x, ctx)
    assert torch.equal(aux.mask_TN, r.mask_TN)
    assert torch.equal(aux.active_counts_N, r.mask_TN.sum(0).float())
    assert aux.active_counts_N.dtype == torch.float32
    _, aux = gm(x)
    assert aux.mask_TN is None
