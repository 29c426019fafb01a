"""Routing statistics: hand-computed ratios on a toy router, and the real micro model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.lab.analysis.routing import (RoutingStats, collect_routing_stats, default_layers,
                                    spearman)

N = 4


class ToyRouter:
    """Stands in for the model: fixed masks from the token ids.

    layer 0: token t activates experts e < t (t=1 -> {0}, t=2 -> {0,1}, t=3 -> {0,1,2});
    layer 1: token t activates expert t mod 4 only.
    """

    config = ReMoEConfig.from_preset("micro", router="relu", num_experts=N, top_k=1)

    def eval(self):
        return self

    def __call__(self, input_ids, record_masks):
        tok = input_ids.reshape(-1)
        e = torch.arange(N)
        m0 = e[None, :] < tok[:, None]
        m1 = e[None, :] == (tok[:, None] % N)
        return SimpleNamespace(aux=SimpleNamespace(masks=[m0, m1]))


# domain A: tokens [1, 1, 2]; domain B: tokens [2, 3, 3] (one row each)
BATCHES = [(torch.tensor([[1, 1, 2], [2, 3, 3]]), torch.tensor([0, 1]))]


def _toy_stats(**kw) -> RoutingStats:
    return collect_routing_stats(ToyRouter(), BATCHES, ["A", "B"], **kw)


def test_domain_ratios_match_hand_computation():
    s = _toy_stats()
    assert s.tokens_D.tolist() == [3, 3]
    r = s.domain_ratio_DLN()
    # layer 0: A = [1,1,2] -> expert 0 by all 3, expert 1 by the "2" only
    assert np.allclose(r[0, 0], [1, 1 / 3, 0, 0])
    # layer 0: B = [2,3,3] -> expert 0 by 3, expert 1 by 3, expert 2 by the two "3"s
    assert np.allclose(r[1, 0], [1, 1, 2 / 3, 0])
    # layer 1: A -> expert 1 (twice), expert 2 (once); B -> expert 2 (once), expert 3 (twice)
    assert np.allclose(r[0, 1], [0, 2 / 3, 1 / 3, 0])
    assert np.allclose(r[1, 1], [0, 0, 1 / 3, 2 / 3])
    assert np.allclose(s.domain_active_DL(), [[4 / 3, 1], [8 / 3, 1]])


def test_routed_ratios_sum_to_mean_active_experts():
    s = _toy_stats()
    ratio = s.routed_ratio_LN()
    assert np.allclose(ratio[0], [1, 4 / 6, 2 / 6, 0])
    assert np.allclose(ratio.sum(1), s.active_experts_L())
    assert np.allclose(s.active_experts_L(), [12 / 6, 1.0])
    assert s.inactive_LN()[0].tolist() == [False, False, False, True]


def test_token_table_and_top_tokens():
    s = _toy_stats(layers=[0, 1])
    t = s.token_table(min_count=1)
    # mean active over the 2 layers: token 3 -> (3+1)/2, token 2 -> (2+1)/2, token 1 -> 1
    assert t["token_id"].tolist() == [3, 2, 1]
    assert np.allclose(t["mean_active"], [2.0, 1.5, 1.0])
    assert t["count"].tolist() == [2, 2, 2] and np.allclose(t["frequency"], 1 / 3)
    assert np.allclose(t["layer_active"], [[3, 1], [2, 1], [1, 1]])
    top = s.top_tokens(0, top=5, min_count=2)
    # expert 1 of layer 0 takes tokens 2 and 3 (2 occurrences each, base frequency 1/3):
    # share 1/2 each, lift 1.5, P(e | v) = 1 (ties -> lower id first)
    assert [(x["token_id"], x["prob"]) for x in top[1]] == [(2, 1.0), (3, 1.0)]
    assert [x["share"] for x in top[1]] == pytest.approx([0.5, 0.5])
    assert [x["lift"] for x in top[1]] == pytest.approx([1.5, 1.5])
    # expert 2 takes only token 3: share 1, lift 3
    assert [(x["token_id"], x["lift"]) for x in top[2]] == [(3, pytest.approx(3.0))]
    # expert 0 takes every token (P(e | v) = 100% for all): nothing is over-represented
    assert top[0] == [] and top[3] == []
    assert s.expert_ratio(0).tolist() == pytest.approx([1, 4 / 6, 2 / 6, 0])
    assert s.top_tokens(0, min_count=3) == [[], [], [], []]


def test_top_tokens_rank_by_excess_share():
    # layer 0, 2 experts; token 0 is frequent (80 occurrences), tokens 1 and 2 rare (10 each).
    # Expert 0 takes all of tokens 0 and 1: P(e | v) = 100% for both, lift 10/9 for both
    # (shares 80/90 and 10/90 vs base 0.8 and 0.1). Expert 1 takes all of token 2 (share
    # 10/50, base 0.1: lift 2) and half of token 0 (share 40/50 = base 0.8: lift 1, not listed).
    count = np.array([80, 10, 10])
    te = np.zeros((3, 1, 2), np.int32)
    te[:, 0, 0] = [80, 10, 0]
    te[:, 0, 1] = [40, 0, 10]
    st = RoutingStats(domains=["A"], tokens_D=np.array([100]),
                      counts_DLN=np.zeros((1, 1, 2), np.int64), token_count_V=count,
                      token_active_VL=np.zeros((3, 1), np.int64), token_expert_VSN=te,
                      kept_layers=[0], top_k=1, num_experts=2)
    top = st.top_tokens(0, min_count=1)
    # expert 0: excess shares 80/90 - 0.8 = 0.0889 and 10/90 - 0.1 = 0.0111 -> token 0 first
    assert [x["token_id"] for x in top[0]] == [0, 1]
    assert [x["prob"] for x in top[0]] == [1.0, 1.0]
    assert [x["lift"] for x in top[0]] == pytest.approx([10 / 9, 10 / 9])
    assert [(x["token_id"], x["lift"]) for x in top[1]] == [(2, pytest.approx(2.0))]
    assert top[1][0]["prob"] == 1.0 and top[1][0]["share"] == pytest.approx(0.2)


def test_max_tokens_cuts_whole_rows():
    s = _toy_stats(max_tokens=3)
    assert s.tokens_D.tolist() == [3, 0]
    assert np.isnan(s.domain_ratio_DLN()[1]).all()
    assert s.specialization()["num_domains"] == 1


def test_specialization_index_hand_values():
    def stats(r_D_N):
        counts = np.asarray(r_D_N, dtype=np.int64)[:, None, :]  # 1 layer, 100 tokens/domain
        return RoutingStats(domains=["A", "B"], tokens_D=np.array([100, 100]),
                            counts_DLN=counts, token_count_V=np.zeros(1, np.int64),
                            token_active_VL=np.zeros((1, 1), np.int64),
                            token_expert_VSN=np.zeros((1, 0, 2), np.int32), kept_layers=[],
                            top_k=1, num_experts=2)

    same = stats([[50, 50], [50, 50]]).specialization()
    assert same["index"] == pytest.approx(0.0) and same["mi_bits"] == pytest.approx(0.0)
    split = stats([[100, 0], [0, 100]]).specialization()
    # each expert: mean 0.5, std 0.5 -> CV 1; p(e|d) one-hot -> 1 bit
    assert split["index"] == pytest.approx(1.0) and split["mi_bits"] == pytest.approx(1.0)
    half = stats([[75, 25], [25, 75]]).specialization()
    assert half["index"] == pytest.approx(0.5)
    h = lambda p: -(p * np.log2(p) + (1 - p) * np.log2(1 - p))  # noqa: E731
    assert half["mi_bits"] == pytest.approx(1 - h(0.75))


def test_real_micro_model_and_roundtrip(tmp_path):
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", router="relu", num_experts=8, granularity=2)
    model = ReMoEForCausalLM(cfg).eval()
    ids = torch.randint(1, 512, (4, 17))
    batches = [(ids[:2], torch.tensor([0, 0])), (ids[2:], torch.tensor([1, 1]))]
    s = collect_routing_stats(model, batches, ["x", "y"], seq_len=16)
    assert s.num_tokens == 64 and s.num_layers == 2 and s.num_routed == 16  # N = E * G
    assert s.target_active == 2 and s.uniform_ratio == 1 / 8
    with torch.no_grad():
        out = model(input_ids=ids[:, :16])
    expected = (out.aux.active_counts_LN.sum(1) / 64).numpy()
    assert np.allclose(s.routed_ratio_LN().sum(1), expected)
    assert np.allclose(s.active_experts_L(), expected)
    assert s.token_count_V.sum() == 64 and s.token_active_VL.sum() == s.counts_DLN.sum()
    s.save(tmp_path / "stats.npz")
    back = RoutingStats.load(tmp_path / "stats.npz")
    assert back.domains == ["x", "y"] and back.kept_layers == default_layers(2) == [0, 1]
    assert back.granularity == 2 and back.top_k == 1 and back.num_experts == 8
    assert np.array_equal(back.counts_DLN, s.counts_DLN)
    assert np.array_equal(back.token_expert_VSN, s.token_expert_VSN)


def test_spearman():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(np.array([1.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(
        np.corrcoef([1.5, 1.5, 3.0], [1, 2, 3])[0, 1])
    assert np.isnan(spearman(x[:2], x[:2]))


def test_expert_use_per_layer_and_the_inactive_rules(tmp_path):
    from remoe.errors import ConfigError
    from remoe.lab.analysis.common import inactive_threshold

    # token 0 activates no expert in layer 0 (e < 0) and expert 0 in layer 1
    s = collect_routing_stats(ToyRouter(), [(torch.tensor([[0, 1, 0], [0, 3, 3]]),
                                             torch.tensor([0, 1]))], ["A", "B"])
    assert s.no_expert_DL.tolist() == [[2, 0], [1, 0]]
    assert s.no_expert_share_L().tolist() == [0.5, 0.0]
    # layer 0 pairs: expert 0 x3, 1 x2, 2 x2 -> load (3, 2, 2, 0) / 7; layer 1: 0 x3, 1 x1, 3 x2
    p0, p1 = np.array([3, 2, 2]) / 7, np.array([3, 1, 2]) / 6
    assert s.effective_experts_L() == pytest.approx([np.exp(-(p0 * np.log(p0)).sum()),
                                                     np.exp(-(p1 * np.log(p1)).sum())])
    assert s.never_firing_L().tolist() == [1, 1]
    # fair share k/E = 1/4: inactive under 1/16 of the tokens; the paper's rule: under 1/64
    assert s.inactive_threshold() == 1 / 16 and s.inactive_threshold("paper") == 1 / 64
    assert inactive_threshold(1 / 128) == 1 / 512  # E = 128: a balanced expert is not flagged
    assert inactive_threshold(1 / 128, "paper") == 1 / 64  # ... by the paper's rule it is
    with pytest.raises(ConfigError, match=r"inactive_rule='x' must be one of fair, paper"):
        inactive_threshold(0.25, "x")
    s.save(tmp_path / "s.npz")  # kept in the cache
    assert RoutingStats.load(tmp_path / "s.npz").no_expert_DL.tolist() == [[2, 0], [1, 0]]
