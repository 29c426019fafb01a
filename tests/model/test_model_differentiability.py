"""ReLU routing is differentiable end to end; TopK jumps at its switching point (paper §3.1-3.2)."""

from __future__ import annotations

import pytest
import torch

from remoe.model.moe import MoEConfig, MoELayer


def _layer(router: str, E: int, k: int = 1, D: int = 4, d_ffn: int = 8, seed: int = 0,
           std: float = 0.5) -> MoELayer:
    torch.manual_seed(seed)
    cfg = MoEConfig.build(d_model=D, d_ffn=d_ffn, num_experts=E, top_k=k, router=router,
                    expert_backend="reference", init_std=std)
    return MoELayer(cfg).double()


def _relu_fd_case():
    """A float64 ReLU MoE layer, inputs whose router logits are all at least 0.05 away from 0."""
    layer = _layer("relu", E=4, seed=0)
    W = layer.router.weight
    for seed in range(100):
        torch.manual_seed(seed)
        x = torch.randn(6, 4, dtype=torch.float64)
        if (x @ W.detach().t()).abs().min() > 0.05:
            break
    logits = x @ W.detach().t()
    assert logits.abs().min() > 0.05, "pick a point away from the ReLU kinks"
    # a mix of inactive pairs and tokens with several active experts
    assert 0 < int((logits > 0).sum()) < logits.numel() and (logits > 0).sum(1).max() > 1
    c = torch.randn(6, 4, dtype=torch.float64)

    def f() -> torch.Tensor:
        # output and the load-balanced L1 term (its f_e is constant near W)
        y, aux = layer(x)
        return (y * c).sum() + 0.3 * aux.reg_loss

    return layer, f


def _router_gradients(eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(autograd gradient, central differences) of f w.r.t. the router weight."""
    layer, f = _relu_fd_case()
    W = layer.router.weight
    W.grad = None
    f().backward()
    grad = W.grad.clone()
    assert grad.abs().max() > 1e-2  # the router really is trained through its gates
    fd = torch.zeros_like(grad)
    with torch.no_grad():
        for i in range(W.shape[0]):
            for j in range(W.shape[1]):
                w0 = W[i, j].item()
                W[i, j] = w0 + eps
                fp = f().item()
                W[i, j] = w0 - eps
                fm = f().item()
                W[i, j] = w0
                fd[i, j] = (fp - fm) / (2 * eps)
    return grad, fd


def test_relu_router_weight_gradient_matches_central_differences():
    """Autograd d f / d W_router == central differences (tolerance of an fp32 router matmul)."""
    grad, fd = _router_gradients(eps=1e-3)
    torch.testing.assert_close(grad, fd, rtol=1e-3, atol=1e-3)


def test_relu_router_weight_gradient_matches_central_differences_float64_exact():
    """The same check at float64 precision: the router must not drop a float64 model to fp32."""
    grad, fd = _router_gradients(eps=1e-6)
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)


def _switching_layers():
    """Two experts with very different outputs for one token x."""
    x = torch.tensor([[1.0, 0.5, -0.3, 0.2]], dtype=torch.float64)
    topk = _layer("topk", E=2, seed=3, std=1.0)
    relu = _layer("relu", E=2, seed=3, std=1.0)
    relu.experts.load_state_dict(topk.experts.state_dict())
    with torch.no_grad():
        y0 = topk.experts(x, torch.tensor([1, 0]))
        y1 = topk.experts(x, torch.tensor([0, 1]))
    assert (y0 - y1).norm() > 0.5
    return x, topk, relu


def _output_jump(layer: MoELayer, x: torch.Tensor, base: torch.Tensor, direction: torch.Tensor,
                 eps: float) -> float:
    with torch.no_grad():
        layer.router.weight.copy_(base + eps * direction)
        y_plus, _ = layer(x)
        layer.router.weight.copy_(base - eps * direction)
        y_minus, _ = layer(x)
    return (y_plus - y_minus).norm().item()


def test_topk_output_jumps_where_relu_output_is_continuous():
    x, topk, relu = _switching_layers()
    direction = torch.zeros(2, 4, dtype=torch.float64)
    direction[1, 0] = 1.0  # moves logit_1 - logit_0 by eps * x_0 = eps

    # TopK (top-1): equal logits at the base point; +-eps swaps the selected expert.
    base_topk = torch.tensor([[0.3, 0.2, 0.1, -0.4], [0.3, 0.2, 0.1, -0.4]], dtype=torch.float64)
    jumps = [_output_jump(topk, x, base_topk, direction, eps) for eps in (1e-4, 1e-7)]
    assert min(jumps) > 0.1  # O(1) ...
    assert jumps[1] == pytest.approx(jumps[0], rel=1e-2)  # ... and it does not shrink with eps

    # ReLU: expert 1's logit is exactly 0 at the base point (its switching point); expert 0 is on.
    base_relu = torch.tensor([[0.3, 0.2, 0.1, -0.4], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    jumps = [_output_jump(relu, x, base_relu, direction, eps) for eps in (1e-4, 1e-7)]
    assert jumps[0] < 10 * 1e-4  # O(eps) ...
    assert jumps[1] == pytest.approx(jumps[0] * 1e-3, rel=1e-3)  # ... and linear in eps
    assert jumps[1] > 0  # expert 1 really switches on between the two points
