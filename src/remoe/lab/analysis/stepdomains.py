"""Per-domain routing estimated from the training log: each logged step's ``expert_counts``
regressed on the domains of that step's batch.

The sampler is a pure function of (seed, step) (:mod:`remoe.data.sampler`), so the domain of
every training sequence is known from the data cache: the record of step k counts the routed
pairs of ``sampler.batch(k - 1)``. Over a late window the model changes slowly, so for each
(layer, expert) the counts obey c_s = sum_d n_{s,d} T_row r_{d,l,e} + noise, with n_{s,d} the
sequences of domain d in step s; least squares gives r_{d,l,e} (clipped at 0). The null
permutes the steps' compositions across steps (a whole batch is the unit). Because the
permutation keeps A^T A, every shuffle costs one product: beta_P = (A^T A)^-1 A[perm]^T Y.

Legend: S steps, D domains, L MoE layers, N experts, P shuffles, K = L*N.
"""

from __future__ import annotations

import numpy as np

from remoe.errors import ConfigError
from remoe.lab.analysis.domainstats import STATISTICS, NullTest, statistic_xL


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
    if shuffles < 2:
        raise ValueError(f"shuffles={shuffles} must be >= 2")
    rng = np.random.default_rng(seed)
    perm_PS = np.stack([rng.permutation(n_SD.shape[0]) for _ in range(shuffles)])
    r_DLN = regressed_ratio_xDLN(n_SD, counts_SLN, row_tokens)
    r_PDLN = regressed_ratio_xDLN(n_SD, counts_SLN, row_tokens, perm_PS)
    return r_DLN, {s: NullTest(s, statistic_xL(s, r_DLN), statistic_xL(s, r_PDLN))
                   for s in statistics}
