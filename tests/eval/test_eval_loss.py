"""evaluate_loss against a hand computation: token-weighted CE overall and per domain."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from remoe.model.losses import evaluate_loss


class BigramModel(nn.Module):
    """Fixed logits: the logits after token t are row t of a table (no learning)."""

    def __init__(self, vocab: int = 7, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=g) * 2)
        self.seen_modes: list[bool] = []
        self.seen_grad: list[bool] = []

    def forward(self, input_ids):
        self.seen_modes.append(self.training)
        self.seen_grad.append(torch.is_grad_enabled())
        return type("Out", (), {"logits": self.table[input_ids]})()


def hand_nll(table: np.ndarray, row: list[int]) -> list[float]:
    """-log softmax(table[x_t])[x_{t+1}] for every t, in float64."""
    out = []
    for a, b in zip(row[:-1], row[1:]):
        z = table[a].astype(np.float64)
        out.append(-(z[b] - (np.log(np.exp(z - z.max()).sum()) + z.max())))
    return out


def test_evaluate_loss_matches_hand_computation_with_two_domains():
    model = BigramModel()
    model.train()
    rng = np.random.default_rng(0)
    # domain 0 gets 3 rows, domain 1 gets 1 row, domain 2 ("empty") none; S + 1 = 6
    rows = rng.integers(0, 7, size=(4, 6))
    doms = np.array([0, 1, 0, 0])
    batches = [(torch.tensor(rows[:3]), torch.tensor(doms[:3])),
               (torch.tensor(rows[3:]), torch.tensor(doms[3:]))]
    res = evaluate_loss(model, batches, ["a", "b", "empty"])

    table = model.table.detach().numpy()
    nll = {0: [], 1: []}
    for r, d in zip(rows.tolist(), doms.tolist()):
        nll[d] += hand_nll(table, r)
    all_nll = nll[0] + nll[1]
    assert res["tokens"] == 4 * 5
    assert res["loss"] == pytest.approx(np.mean(all_nll), rel=1e-6)
    assert res["ppl"] == pytest.approx(math.exp(np.mean(all_nll)), rel=1e-6)
    assert set(res["domains"]) == {"a", "b"}  # a domain without tokens is left out
    assert res["domains"]["a"]["tokens"] == 15 and res["domains"]["b"]["tokens"] == 5
    assert res["domains"]["a"]["loss"] == pytest.approx(np.mean(nll[0]), rel=1e-6)
    assert res["domains"]["b"]["loss"] == pytest.approx(np.mean(nll[1]), rel=1e-6)
    assert res["domains"]["b"]["ppl"] == pytest.approx(math.exp(np.mean(nll[1])), rel=1e-6)
    # token-weighted, not the mean of the domain means
    assert res["loss"] != pytest.approx((np.mean(nll[0]) + np.mean(nll[1])) / 2, rel=1e-9)
    # ran in eval mode without grad, and gave the train mode back
    assert model.seen_modes == [False, False] and model.seen_grad == [False, False]
    assert model.training


def test_evaluate_loss_max_batches_and_empty():
    model = BigramModel()
    model.eval()
    rows = torch.randint(0, 7, (2, 4))
    batches = [(rows[:1], torch.tensor([0])), (rows[1:], torch.tensor([1]))]
    one = evaluate_loss(model, batches, ["a", "b"], max_batches=1)
    assert one["tokens"] == 3 and set(one["domains"]) == {"a"}
    assert not model.training
    none = evaluate_loss(model, [], ["a"])
    assert none["tokens"] == 0 and math.isnan(none["loss"]) and none["domains"] == {}


def test_evaluate_loss_equals_the_models_own_lm_loss(make_micro_model):
    model = make_micro_model()
    ids = torch.randint(1, 300, (3, 17))
    res = evaluate_loss(model, [(ids, torch.zeros(3, dtype=torch.long))], ["only"], device="cpu")
    with torch.no_grad():  # the model's LM loss on the S+1 tokens predicts the same S targets
        ref = model(input_ids=ids, labels=ids).loss
    assert res["tokens"] == 3 * 16
    assert res["loss"] == pytest.approx(float(ref), rel=1e-5)
