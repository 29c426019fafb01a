"""`remoe analyze gates`: gate scale and the FFN's share of the residual stream, by hooks."""

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.lab.analysis.gates import gate_stats


def _stats(**kw):
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", vocab_size=128, **kw))
    ids = torch.randint(0, 128, (4, 16))
    return model, gate_stats(model, [(ids,)])


def test_topk_gates_are_softmax_probabilities_and_renormalised_gates_sum_to_one():
    _, plain = _stats(router="topk", num_experts=8, top_k=1)
    _, norm = _stats(router="topk", num_experts=8, top_k=2, topk_normalize=True)
    for r in plain:
        assert r["active"] == 1.0 and r["tokens"] == 64
        # one kept softmax probability of 8 experts: above 1/8, far below 1 at initialisation
        assert 1 / 8 <= r["gate_sum_p10"] <= r["gate_sum"] <= r["gate_sum_p90"] < 0.5
        assert r["gate_active"] == pytest.approx(r["gate_sum"])
        assert r["ffn_rel"] > 0
    for r in norm:
        assert r["active"] == 2.0 and r["gate_sum"] == pytest.approx(1.0, abs=1e-6)


def test_ffn_share_matches_a_direct_computation_and_dense_has_no_gates():
    model, rows = _stats(router="dense")
    assert all("gate_sum" not in r for r in rows)
    # layer 0 by hand: h = embeddings + attention; y = ffn(ffn_norm(h))
    ids = torch.randint(0, 128, (4, 16))
    torch.manual_seed(0)
    rows = gate_stats(model, [(ids,)])
    block = model.layers[0]
    seen = {}
    hook = block.ffn_norm.register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0]))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    h = seen["h"]
    with torch.no_grad():
        y, _ = block.ffn(block.ffn_norm(h), None)
    want = (y.norm(dim=-1) / h.norm(dim=-1)).mean().item()
    assert rows[0]["ffn_rel"] == pytest.approx(want, rel=1e-5)


def test_relu_gate_sum_counts_only_open_gates():
    _, rows = _stats(router="relu", num_experts=8, top_k=1)
    for r in rows:
        assert 0 < r["active"] <= 8 and r["gate_sum_p10"] >= 0
        assert r["gate_sum"] == pytest.approx(r["gate_active"] * r["active"], rel=1e-5)
