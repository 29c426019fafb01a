"""Lory (Zhong et al. 2024): causal segment routing + expert merging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remoe import ConfigError, ReMoEConfig, ReMoEForCausalLM
from remoe.model.lory import LoryMoE
from remoe.model.moe import MoEConfig, build_ffn
from remoe.model.routers import RouterContext

L = 4  # segment length in these tests


def _lory(first_segment: str = "uniform", E: int = 3, D: int = 4, H: int = 6) -> LoryMoE:
    torch.manual_seed(0)
    layer = build_ffn(MoEConfig.build(d_model=D, d_ffn=H, num_experts=E, router="lory",
                                lory_segment_len=L, lory_first_segment=first_segment,
                                init_std=0.5))
    assert isinstance(layer, LoryMoE)
    return layer


def _model(first_segment: str = "uniform") -> ReMoEForCausalLM:
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", router="lory", lory_segment_len=L,
                                  lory_first_segment=first_segment)
    return ReMoEForCausalLM(cfg).eval()


def _reference(layer: LoryMoE, x_BSD: torch.Tensor) -> torch.Tensor:
    """Segment by segment, from the formulas: merged weights from the previous segment's mean."""
    B, S, D = x_BSD.shape
    E = layer.num_experts
    W_r, W_in, W_out = layer.router.weight, layer.experts.w_in_ND2H, layer.experts.w_out_NHD
    y = torch.empty_like(x_BSD)
    for b in range(B):
        for s0 in range(0, S, L):
            if s0 == 0:
                r = torch.full((E,), 1.0 / E)
            else:
                r = torch.softmax(W_r @ x_BSD[b, s0 - L:s0].mean(0), dim=0)
            w_in = sum(r[e] * W_in[e] for e in range(E))
            w_out = sum(r[e] * W_out[e] for e in range(E))
            gate, up = (x_BSD[b, s0:s0 + L] @ w_in).chunk(2, dim=-1)
            y[b, s0:s0 + L] = (F.silu(gate) * up) @ w_out
    return y


def test_merged_expert_per_segment_matches_the_formula():
    layer = _lory()
    x = torch.randn(2, 11, 4)  # segments of 4, 4, 3
    y, aux = layer(x, RouterContext(batch_size=2, seq_len=11, record_masks=True))
    torch.testing.assert_close(y, _reference(layer, x), atol=1e-5, rtol=1e-5)
    assert aux.active_counts_N.tolist() == [22.0] * 3  # every expert serves every token
    assert aux.aux_loss.item() == 0.0 and aux.reg_loss.item() == 0.0
    assert aux.mask_TN.shape == (22, 3) and aux.mask_TN.all()


def test_layer_is_causal_at_segment_level():
    layer = _lory()
    x = torch.randn(1, 12, 4)
    ctx = RouterContext(batch_size=1, seq_len=12)
    with torch.no_grad():
        y0, _ = layer(x, ctx)
        x2 = x.clone()
        x2[0, 5] += 1.0  # a token of segment 1
        y1, _ = layer(x2, ctx)
    assert torch.equal(y1[0, :5], y0[0, :5])  # earlier positions: bit-identical
    assert not torch.allclose(y1[0, 5], y0[0, 5])  # the token itself
    assert torch.equal(y1[0, 6:8], y0[0, 6:8])  # same segment: the same merged expert
    assert not torch.allclose(y1[0, 8:], y0[0, 8:])  # next segment: routed by segment 1's mean


def test_model_has_no_information_from_future_tokens():
    model = _model()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        for p in (2, 9):  # inside the first segment and inside the third
            ids2 = ids.clone()
            ids2[:, p] = (ids2[:, p] + 1) % 512
            out = model(ids2).logits
            assert torch.equal(out[:, :p], base[:, :p]), p
            assert not torch.allclose(out[:, p], base[:, p])
            later = (out[:, p + 1:] - base[:, p + 1:]).abs().amax(-1)
            assert (later > 0).all(), p


def test_self_first_segment_is_lorys_stop_gradient_routing():
    """Lory's Algorithm 1 (opt-in): segment 0 routes on its own mean -- which leaks within it."""
    layer = _lory("self")
    x = torch.randn(1, 8, 4, requires_grad=True)
    y, _ = layer(x, RouterContext(batch_size=1, seq_len=8))
    r0 = torch.softmax(layer.router.weight @ x[0, :L].detach().mean(0), dim=0)
    w_in = torch.einsum("e,edh->dh", r0, layer.experts.w_in_ND2H)
    w_out = torch.einsum("e,ehd->hd", r0, layer.experts.w_out_NHD)
    gate, up = (x[0, :L] @ w_in).chunk(2, dim=-1)
    torch.testing.assert_close(y[0, :L], (F.silu(gate) * up) @ w_out, atol=1e-5, rtol=1e-5)
    # stop-gradient: the router learns nothing from segment 0's own routing
    y[0, :L].sum().backward()
    assert layer.router.weight.grad is None or layer.router.weight.grad.abs().sum() == 0
    # ... and a later token of segment 0 changes an earlier output (the documented leak)
    model = _model("self")
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        ids[0, 2] = (ids[0, 2] + 1) % 512
        assert not torch.equal(model(ids).logits[0, :2], base[0, :2])


def test_router_learns_from_later_segments():
    layer = _lory()
    x = torch.randn(2, 8, 4)
    y, _ = layer(x[:, :L], RouterContext(batch_size=2, seq_len=L))
    y.sum().backward()
    assert layer.router.weight.grad is None or layer.router.weight.grad.abs().sum() == 0
    layer.zero_grad()
    y, _ = layer(x, RouterContext(batch_size=2, seq_len=8))
    y.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w_in_ND2H.grad.abs().amin(dim=(1, 2)).gt(0).all()  # every expert


@pytest.mark.parametrize("first_segment", ["uniform", "self"])
def test_kv_cache_decoding_matches_the_full_forward(first_segment):
    model = _model(first_segment)
    ids = torch.randint(0, 512, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        P = 4 if first_segment == "self" else 5  # "self": the prompt must cover segment 0
        out = model(ids[:, :P], use_cache=True)
        steps = [out.logits]
        for t in range(P, ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_generate_and_stream_errors():
    model = _model()
    ids = torch.randint(0, 512, (2, 3), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                         do_sample=False)
    assert out.shape == (2, 12)  # crosses two segment boundaries
    with torch.no_grad():  # greedy tokens equal the arg-max of a full forward over them
        logits = model(out[:, :-1]).logits
    assert torch.equal(logits[:, 2:].argmax(-1), out[:, 3:])
    layer = model.layers[0].ffn
    with pytest.raises(RuntimeError, match="continuation"):
        layer(torch.randn(2, 1, 64), RouterContext(batch_size=2, seq_len=1, past_len=99))


def test_parameters_and_config_checks():
    with torch.device("meta"):
        lory = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="lory"))
        topk = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk"))
    assert lory.num_parameters() == topk.num_parameters()  # same experts + an [E, D] router
    assert lory.num_parameters(active=True) == lory.num_parameters()  # all experts merged
    with pytest.raises(ConfigError, match="top_k"):
        ReMoEConfig.from_preset("micro", router="lory", top_k=2)
    with pytest.raises(ConfigError, match="lory_first_segment"):
        ReMoEConfig.from_preset("micro", router="lory", lory_first_segment="prompt")
