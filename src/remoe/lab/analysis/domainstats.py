"""Domain-specialisation statistics of routed-token ratios, and their shuffle null.

Pure numpy. ``r_xDLN`` is the routed-tokens ratio r_{d,l,e} = #{t in d : M^l_{t,e}} / T_d with
any leading dimensions x (e.g. P shuffles). Two statistics per layer (docs/ANALYSIS.md):

* ``mi``: domain-balanced mutual information between the domain and the expert of a routed
  (token, expert) pair, I_l = (1/D) sum_d KL(p_l(.|d) || mean_d' p_l(.|d')), bits (<= log2 D);
* ``cv``: mean over experts of the coefficient of variation of r_{d,l,e} across domains.

The null (:func:`shuffle_test`) recomputes them with the domain labels permuted across *units*
(whole sequences, never single tokens, so the correlation of a sequence's tokens is kept).

Per-domain routing can also be estimated from the training log (:func:`regression_test`): each
logged step's ``expert_counts`` regressed on the domains of that step's batch. The sampler is a
pure function of (seed, step) (:mod:`remoe.data.sampler`), so the domain of every training
sequence is known from the data cache: the record of step k counts the routed pairs of
``sampler.batch(k - 1)``. Over a late window the model changes slowly, so for each (layer,
expert) the counts obey c_s = sum_d n_{s,d} T_row r_{d,l,e} + noise, with n_{s,d} the sequences
of domain d in step s; least squares gives r_{d,l,e} (clipped at 0). The null permutes the
steps' compositions across steps (a whole batch is the unit). Because the permutation keeps
A^T A, every shuffle costs one product: beta_P = (A^T A)^-1 A[perm]^T Y.

Legend: R units (sequences), D domains, L MoE layers, N experts, P shuffles, S steps,
K = L*N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remoe.errors import ConfigError

STATISTICS = ("mi", "cv")


def mi_bits_xL(r_xDLN: np.ndarray) -> np.ndarray:
    """Domain-balanced domain-expert MI per layer, bits; NaN where a domain routed nothing."""
    tot_xDL = r_xDLN.sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_xDLN = r_xDLN / tot_xDL[..., None]
        pbar_xLN = p_xDLN.mean(-3)
        terms = np.where(p_xDLN > 0, p_xDLN * np.log2(p_xDLN / pbar_xLN[..., None, :, :]), 0.0)
    mi_xL = terms.sum(-1).mean(-2)
    return np.where((tot_xDL > 0).all(-2), mi_xL, np.nan)


def cv_xLN(r_xDLN: np.ndarray) -> np.ndarray:
    """Coefficient of variation across domains per (layer, expert); NaN for unused experts."""
    mean = r_xDLN.mean(-3)
    std = r_xDLN.std(-3)
    ok = mean > 0
    return np.where(ok, std / np.where(ok, mean, 1.0), np.nan)


def cv_index_xL(r_xDLN: np.ndarray) -> np.ndarray:
    """Mean over the used experts of each layer of :func:`cv_xLN` (NaN: no used expert)."""
    cv = cv_xLN(r_xDLN)
    n = np.isfinite(cv).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(cv, -1) / np.maximum(n, 1), np.nan)


def statistic_xL(name: str, r_xDLN: np.ndarray) -> np.ndarray:
    if name == "mi":
        return mi_bits_xL(r_xDLN)
    if name == "cv":
        return cv_index_xL(r_xDLN)
    raise ValueError(f"unknown statistic {name!r}; choose from {', '.join(STATISTICS)}")


def unit_counts(masks_LTN: np.ndarray, unit_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Routed pairs per unit of ``unit_len`` consecutive tokens: ``(counts_RLN, tokens_R)``."""
    L, T, N = masks_LTN.shape
    if unit_len < 1 or T % unit_len:
        raise ValueError(f"{T} tokens do not split into units of {unit_len}")
    R = T // unit_len
    counts_RLN = masks_LTN.reshape(L, R, unit_len, N).sum(2, dtype=np.int64).transpose(1, 0, 2)
    return counts_RLN, np.full(R, unit_len, dtype=np.int64)


def domain_ratio_xDLN(counts_RLN: np.ndarray, tokens_R: np.ndarray, labels_xR: np.ndarray,
                      num_domains: int) -> np.ndarray:
    """r_{d,l,e} of the units labelled ``labels_xR`` (values 0..D-1; NaN for an empty domain)."""
    onehot_xRD = (labels_xR[..., None] == np.arange(num_domains)).astype(np.float64)
    counts_xDLN = np.einsum("...rd,rln->...dln", onehot_xRD, counts_RLN.astype(np.float64))
    tokens_xD = onehot_xRD.swapaxes(-1, -2) @ tokens_R.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return counts_xDLN / tokens_xD[..., None, None]


@dataclass
class NullTest:
    """One statistic of the observed labels against its shuffled-label null."""

    statistic: str
    observed_L: np.ndarray  # [L]
    null_PL: np.ndarray  # [P, L]

    def _rows(self, obs: np.ndarray, null_P: np.ndarray) -> dict:
        null_P = null_P[np.isfinite(null_P)]
        if not np.isfinite(obs) or null_P.size < 2:
            return {"observed": float(obs), "null_mean": float("nan"), "null_std": float("nan"),
                    "null_q95": float("nan"), "excess": float("nan"), "z": float("nan"),
                    "p": float("nan"), "shuffles": int(null_P.size)}
        mean, std = float(null_P.mean()), float(null_P.std(ddof=1))
        tie = 1e-9 * max(1.0, abs(float(obs)))  # the observed labelling recurs among shuffles
        return {"observed": float(obs), "null_mean": mean, "null_std": std,
                "null_q95": float(np.quantile(null_P, 0.95)), "excess": float(obs) - mean,
                "z": (float(obs) - mean) / std if std > 0 else float("nan"),
                "p": float((1 + np.sum(null_P >= obs - tie)) / (1 + null_P.size)),
                "shuffles": int(null_P.size)}

    def per_layer(self) -> list[dict]:
        return [{"layer": l, **self._rows(self.observed_L[l], self.null_PL[:, l])}
                for l in range(self.observed_L.size)]

    def layer_mean(self) -> dict:
        """The same test for the mean over layers (one shuffle moves every layer's labels)."""
        with np.errstate(invalid="ignore"):
            return {"layer": "mean", **self._rows(np.nanmean(self.observed_L),
                                                    np.nanmean(self.null_PL, axis=1))}


def shuffled_labels_PR(labels_R: np.ndarray, shuffles: int, seed: int) -> np.ndarray:
    """``shuffles`` permutations of the unit labels (the domains' unit counts are kept)."""
    if shuffles < 2:
        raise ValueError(f"shuffles={shuffles} must be >= 2")
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(labels_R) for _ in range(shuffles)])


def shuffle_test(counts_RLN: np.ndarray, tokens_R: np.ndarray, labels_R: np.ndarray,
                 shuffles: int = 1000, seed: int = 0,
                 statistics: tuple[str, ...] = STATISTICS,
                 labels_PR: np.ndarray | None = None) -> dict[str, NullTest]:
    """Each statistic on the observed unit labels and on ``shuffles`` permutations of them.

    ``labels_R``: the domain of each unit, 0..D-1 with every value present. ``labels_PR``: the
    permutations to use (e.g. the same ones for several snapshots); default drawn from ``seed``.
    """
    labels_R = np.asarray(labels_R, dtype=np.int64)
    if labels_R.shape != tokens_R.shape or counts_RLN.shape[0] != labels_R.size:
        raise ValueError(f"{labels_R.size} labels for {counts_RLN.shape[0]} units")
    D = int(labels_R.max()) + 1 if labels_R.size else 0
    if D < 2 or np.unique(labels_R).size != D:
        raise ValueError(f"labels must cover 0..D-1 with D >= 2, got {sorted(set(labels_R))}")
    if labels_PR is None:
        labels_PR = shuffled_labels_PR(labels_R, shuffles, seed)
    r_DLN = domain_ratio_xDLN(counts_RLN, tokens_R, labels_R, D)
    r_PDLN = domain_ratio_xDLN(counts_RLN, tokens_R, labels_PR, D)
    return {s: NullTest(s, statistic_xL(s, r_DLN), statistic_xL(s, r_PDLN)) for s in statistics}


def step_counts(records: list[dict], last_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps_S, counts_SLN)`` of the last ``last_steps`` records with ``expert_counts``."""
    recs = [r for r in records if r.get("expert_counts")]
    if not recs:
        raise ConfigError("metrics.jsonl has no expert_counts (not an MoE run?)")
    recs = recs[-last_steps:]
    return (np.array([int(r["step"]) for r in recs], dtype=np.int64),
            np.array([r["expert_counts"] for r in recs], dtype=np.float64))


def step_compositions_SD(sampler, steps_S: np.ndarray, num_domains: int,
                         offset: int = 0) -> np.ndarray:
    """Sequences per domain in the batches of the logged ``steps_S`` (all micro steps;
    ``offset`` shifts the alignment, for the check that only the true one carries signal)."""
    dom = sampler.table.domain_ids
    out = np.zeros((steps_S.size, num_domains), dtype=np.float64)
    for i, s in enumerate(steps_S):
        for m in range(sampler.grad_accum):
            out[i] += np.bincount(dom[sampler.chunk_indices(int(s) - 1 + offset, m)],
                                  minlength=num_domains)
    return out


def regressed_ratio_xDLN(n_SD: np.ndarray, counts_SLN: np.ndarray, row_tokens: int,
                         perm_PS: np.ndarray | None = None) -> np.ndarray:
    """Least-squares r_{d,l,e} (>= 0) of the compositions ``n_SD`` (permuted by ``perm_PS``)."""
    S, L, N = counts_SLN.shape
    A_SD = n_SD * float(row_tokens)
    gram = A_SD.T @ A_SD
    if np.linalg.matrix_rank(gram) < gram.shape[0]:
        raise ConfigError(f"the {S} steps' domain mixes do not separate the "
                          f"{n_SD.shape[1]} domains (use more steps)")
    Y_SK = counts_SLN.reshape(S, L * N)
    A_xSD = A_SD if perm_PS is None else A_SD[perm_PS]
    beta_xDK = np.linalg.solve(gram, np.einsum("...sd,sk->...dk", A_xSD, Y_SK))
    return np.clip(beta_xDK, 0.0, None).reshape(*beta_xDK.shape[:-1], L, N)


def regression_test(n_SD: np.ndarray, counts_SLN: np.ndarray, row_tokens: int,
                    shuffles: int = 1000, seed: int = 0,
                    statistics: tuple[str, ...] = STATISTICS
                    ) -> tuple[np.ndarray, dict[str, NullTest]]:
    """``(r_DLN, tests)``: the regressed ratios and each statistic against step shuffles."""
    perm_PS = shuffled_labels_PR(np.arange(n_SD.shape[0]), shuffles, seed)
    r_DLN = regressed_ratio_xDLN(n_SD, counts_SLN, row_tokens)
    r_PDLN = regressed_ratio_xDLN(n_SD, counts_SLN, row_tokens, perm_PS)
    return r_DLN, {s: NullTest(s, statistic_xL(s, r_DLN), statistic_xL(s, r_PDLN))
                   for s in statistics}
