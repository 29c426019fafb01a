"""Expert-Choice routing (Zhou et al. 2022): every expert takes exactly its capacity C."""

from __future__ import annotations

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model.moe import MoEConfig, MoELayer
from remoe.model.routers import RouterContext
from remoe.model.routers.expert_choice import expert_capacity


def _layer(E=8, k=1, G=1, cf=1.0, D=16) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig.build(d_model=D, d_ffn=32, num_experts=E, top_k=k, granularity=G,
                              router="expert_choice", capacity_factor=cf, init_std=0.3,
                              expert_backend="reference"))


@pytest.mark.parametrize("E, k, G, cf, T", [(8, 1, 1, 1.0, 48), (8, 1, 1, 2.0, 48),
                                             (8, 2, 1, 0.5, 40), (4, 1, 2, 1.0, 36)])
def test_per_expert_load_equals_capacity(E, k, G, cf, T):
    layer = _layer(E, k, G, cf)
    N = E * G
    C = round(T * k * G / N * cf)
    assert expert_capacity(T, N, k * G, cf) == C
    x = torch.randn(T, 16)
    ctx = RouterContext(batch_size=2, seq_len=T // 2, step=0, record_masks=True)
    _, aux = layer(x, ctx)
    assert aux.active_counts_N.tolist() == [float(C)] * N
    # each expert's chosen tokens are its C best-scoring ones; gates are those scores
    r = layer.router(x, ctx)
    scores = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    for n in range(N):
        chosen, rest = scores[r.mask_TN[:, n], n], scores[~r.mask_TN[:, n], n]
        assert chosen.numel() == C and (rest.numel() == 0 or chosen.min() >= rest.max())
    torch.testing.assert_close(r.gates_TN, scores * r.mask_TN)
    # tokens get a variable number of experts (0..N), not a fixed k
    per_token = r.mask_TN.sum(1)
    assert per_token.min() != per_token.max()


def test_model_forward_balances_every_layer():
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="expert_choice"))
    ids = torch.randint(0, 512, (4, 16))
    out = model(ids, labels=ids, train_step=0)
    assert torch.equal(out.aux.active_counts_LN, torch.full((2, 8), 8.0))  # C = 64 * 1 / 8
    assert out.aux.aux_loss.item() == 0.0  # balanced by construction: no auxiliary loss
    out.loss.backward()
    assert model.layers[0].ffn.router.weight.grad.abs().sum() > 0  # gates = scores: trained


def test_decoding_step_falls_back_to_token_choice():
    layer = _layer(E=8, k=2)
    x = torch.randn(3, 16)
    r = layer.router(x, RouterContext(batch_size=3, seq_len=1, step=None))
    assert (r.mask_TN.sum(1) == 2).all()
    scores = torch.softmax(x @ layer.router.weight.t(), dim=-1)
    assert torch.equal(r.mask_TN, scores >= scores.topk(2, dim=-1).values[:, -1:])
    # a one-position training batch or an inference prefill still uses expert choice
    for ctx in (RouterContext(3, 1, step=5), RouterContext(1, 3, step=None)):
        r = layer.router(x, ctx)
        assert r.mask_TN.sum(0).tolist() == [1] * 8  # C = max(1, round(3 * 2 / 8))
