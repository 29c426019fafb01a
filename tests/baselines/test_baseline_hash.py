"""Hash routing (Roller et al. 2021): experts are a pure function of the token id."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext


def _layer(E: int = 8, k: int = 1, G: int = 1, D: int = 8, d_ffn: int = 16) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig.build(d_model=D, d_ffn=d_ffn, num_experts=E, top_k=k, granularity=G,
                              router="hash", expert_backend="reference", init_std=0.5))


def test_k1_is_token_id_mod_E_with_unit_gates():
    layer = _layer(E=8)
    ids = torch.tensor([0, 1, 7, 8, 9, 15, 16, 511, 100, 3])
    x = torch.randn(ids.numel(), 8)
    y, aux = layer(x, RouterContext(1, ids.numel(), token_ids_T=ids, record_masks=True))
    assert torch.equal(aux.mask_TN, F.one_hot(ids % 8, 8).bool())
    # the gate is exactly 1: the output is the hashed expert's output, unscaled
    w_in, w_out = layer.experts.w_in_ND2H, layer.experts.w_out_NHD
    for t, e in enumerate((ids % 8).tolist()):
        gate, up = (x[t] @ w_in[e]).chunk(2)
        torch.testing.assert_close(y[t], (F.silu(gate) * up) @ w_out[e])


@pytest.mark.parametrize("E, k, G", [(8, 2, 1), (8, 3, 1), (8, 1, 4), (4, 2, 2)])
def test_multi_expert_extension_is_deterministic_and_distinct(E, k, G):
    layer = _layer(E=E, k=k, G=G)
    N, K = E * G, k * G
    ids = torch.arange(3 * N)
    _, aux = layer(torch.randn(ids.numel(), 8),
                   RouterContext(1, ids.numel(), token_ids_T=ids, record_masks=True))
    mask = aux.mask_TN
    assert (mask.sum(1) == K).all()  # K distinct experts per token
    stride = N // K
    for t in ids.tolist():
        expected = {(t + j * stride) % N for j in range(K)}
        assert set(mask[t].nonzero().flatten().tolist()) == expected
    r = layer.router(torch.randn(ids.numel(), 8), RouterContext(1, ids.numel(), token_ids_T=ids))
    assert torch.equal(r.gates_TN, mask.float())


def test_routing_ignores_context_in_the_model():
    """Same id -> same experts in every layer, whatever the surrounding tokens and position."""
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="hash")).eval()
    g = torch.Generator().manual_seed(1)
    ids_a = torch.randint(0, 512, (2, 24), generator=g)
    ids_b = ids_a.flatten()[torch.randperm(48, generator=g)].view(2, 24)  # shuffled contexts
    ids_b[:, ::5] = torch.randint(0, 512, ids_b[:, ::5].shape, generator=g)  # and new neighbours
    with torch.no_grad():
        out_a = model(ids_a, record_masks=True)
        out_b = model(ids_b, record_masks=True)
    flat_a, flat_b = ids_a.flatten(), ids_b.flatten()
    logits_a, logits_b = out_a.logits.flatten(0, 1), out_b.logits.flatten(0, 1)
    checked, contexts_differ = 0, 0
    for layer, (m_a, m_b) in enumerate(zip(out_a.aux.masks, out_b.aux.masks)):
        assert torch.equal(m_a, F.one_hot(flat_a % 8, 8).bool())
        for tb, tok in enumerate(flat_b.tolist()):
            for ta in (flat_a == tok).nonzero().flatten().tolist():
                assert torch.equal(m_a[ta], m_b[tb]), (layer, tok)
                checked += 1
                # the token's hidden state does depend on its context; its routing does not
                contexts_differ += not torch.allclose(logits_a[ta], logits_b[tb])
    assert checked > 40 and contexts_differ > 40


def test_missing_token_ids_is_a_clear_error():
    layer = _layer()
    with pytest.raises(ValueError, match="token_ids_T"):
        layer(torch.randn(4, 8))


def test_no_router_parameters():
    layer = _layer()
    assert layer.router.weight is None
    assert sum(p.numel() for p in layer.router.parameters()) == 0
    with torch.device("meta"):
        hash_m = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="hash"))
        topk_m = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk"))
    c = hash_m.config
    router = c.backbone.num_layers * c.routing.num_experts * c.hidden_size
    assert hash_m.num_parameters() == topk_m.num_parameters() - router
    assert hash_m.num_parameters(active=True) == topk_m.num_parameters(active=True) - router
