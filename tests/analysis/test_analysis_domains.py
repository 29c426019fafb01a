"""Domain specialisation with a shuffle null (``remoe analyze domains``): synthetic routings
whose answer is known -- routing that depends on the domain gives a large z, routing that does
not gives z ~ 0 -- for both sources (calibration sequences, training steps regressed on their
batches' domains), and the calibration rows' domains recovered from a data cache."""

from __future__ import annotations

import numpy as np
import pytest

from remoe.errors import ConfigError
from remoe.lab.analysis.domainspec import partitions_p_floor, row_domains_R, validation_index
from remoe.lab.analysis.domainstats import mi_bits_xL, regression_test, shuffle_test, unit_counts
from remoe.lab.analysis.routing import RoutingStats

D, L, N, SEQ = 4, 2, 8, 64


def _masks(labels_R, depend: bool, rng) -> np.ndarray:
    """k=1 routing of R sequences: expert d (of domain d) with prob 0.5 when ``depend``."""
    R = labels_R.size
    pick = rng.integers(0, N, size=(L, R, SEQ))
    if depend:
        own = rng.random((L, R, SEQ)) < 0.5
        pick = np.where(own, labels_R[None, :, None], pick)
    masks = np.zeros((L, R * SEQ, N), dtype=bool)
    np.put_along_axis(masks, pick.reshape(L, R * SEQ, 1), True, axis=2)
    return masks


@pytest.mark.parametrize("depend", [True, False])
def test_sequence_shuffle_null_separates_domain_routing_only(depend):
    rng = np.random.default_rng(1)
    labels_R = np.repeat(np.arange(D), 6)
    counts_RLN, tokens_R = unit_counts(_masks(labels_R, depend, rng), SEQ)
    t = shuffle_test(counts_RLN, tokens_R, labels_R, shuffles=300, seed=0)["mi"].layer_mean()
    if depend:
        assert t["z"] > 10 and t["p"] < 0.01, t
    else:
        assert abs(t["z"]) < 3 and t["p"] > 0.01, t
        assert t["observed"] > 0  # plug-in MI is biased up: the null, not 0, is the reference


def test_mi_matches_routing_stats_and_is_log2_d_for_disjoint_domains():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(D, L, N)).astype(np.int64)
    tokens = np.full(D, 100, np.int64)
    st = RoutingStats(domains=[f"d{i}" for i in range(D)], tokens_D=tokens, counts_DLN=counts,
                      token_count_V=np.zeros(1, np.int64), token_active_VL=np.zeros((1, L)),
                      token_expert_VSN=np.zeros((1, 0, N)), kept_layers=[], num_experts=N)
    np.testing.assert_allclose(st.specialization()["mi_bits_per_layer"],
                               mi_bits_xL(counts / tokens[:, None, None]))
    disjoint = np.zeros((D, L, N))
    disjoint[np.arange(D), :, np.arange(D)] = 1.0
    np.testing.assert_allclose(mi_bits_xL(disjoint), np.log2(D))


@pytest.mark.parametrize("depend", [True, False])
def test_step_regression_recovers_domain_ratios_and_its_null(depend):
    rng = np.random.default_rng(2)
    S, rows, T = 300, 16, 65
    n_SD = rng.multinomial(rows, np.full(D, 1 / D), size=S).astype(float)
    r_DLN = np.full((D, L, N), 1.0 / N)
    if depend:
        r_DLN = 0.5 * r_DLN
        r_DLN[np.arange(D), :, np.arange(D)] += 0.5
    mean_SLN = np.einsum("sd,dln->sln", n_SD * T, r_DLN)
    counts_SLN = rng.poisson(mean_SLN * (1 + 0.05 * rng.standard_normal((S, 1, 1))))
    est, tests = regression_test(n_SD, counts_SLN.astype(float), T, shuffles=200, seed=0)
    t = tests["mi"].layer_mean()
    if depend:
        np.testing.assert_allclose(est, r_DLN, atol=0.03)
        assert t["z"] > 10 and t["p"] < 0.01, t
    else:
        assert abs(t["z"]) < 3 and t["p"] > 0.01, t


def test_p_floor_counts_distinct_partitions():
    # 8 sequences in domains of 2, 2, 2, 1, 1: 8!/(2!^3) labelings, / (3! 2!) renamings
    assert partitions_p_floor([2, 2, 2, 1, 1]) == pytest.approx(1 / 420)


def test_calibration_rows_get_their_domains_from_the_cache(micro_data_cfg):
    from remoe.data import load_prepared
    from remoe.train.metrics import calibration_set

    bundle = load_prepared(micro_data_cfg.cache_dir, verify=False)
    seq = 32
    calib = calibration_set(bundle, seq, 8 * seq)  # the trainer's calibration rows
    first = [next(iter(bundle.eval_batches("validation", seq, 1, max_chunks_per_domain=2)))]
    index = validation_index(bundle, seq)
    got = row_domains_R(calib.reshape(-1).numpy(), seq, index)
    assert got.shape == (calib.shape[0],) and len(set(got.tolist())) == min(
        len(bundle.domains), calib.shape[0])
    assert got[0] == int(first[0].domain_ids[0])  # round robin: domain 0 first
    with pytest.raises(ConfigError, match="not a validation chunk"):
        row_domains_R(np.full(seq, 3, np.int64), seq, index)
