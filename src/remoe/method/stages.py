"""Three-stage training (paper §3.5, Fig. 4) and the settling time (Appendix B).

Given the per-step sparsity S_i (steps s_1 < ... < s_n), the target tau = 1 - k/E, the
regularisation term R_i = lambda_i * L_reg,i and the LM loss L_lm,i:

* **Stage III (stable) starts** at the settling step s_{j2}: the first step from which the
  sparsity stays inside the band |S - tau| <= ``tol`` until the end of the log, provided that
  is at least ``window`` records, i.e. j2 = min{ j : |S_i - tau| <= tol for all i >= j } when
  n - j2 >= window. An excursion out of the band moves the settling step past it: "settled"
  means "stays in the band from there on", not "spent ``window`` steps in it once". None when
  the last ``window`` records are not all inside the band (the run has not settled, yet).
* **Stage II (sparsifying) starts** at s_{j1}, the first step at which the regularisation
  becomes non-negligible: j1 = min{ j : R_j >= ``eps`` * L_lm,j } (eps = 1e-3: 0.1% of the LM
  loss), capped at j2. Stage I (dense) is [s_1, s_{j1}). With lambda growing by alpha per step
  the boundary moves by only log(10)/log(alpha) steps (13 for alpha = 1.2) per decade of eps.
  Runs without an adaptive lambda (TopK, warm-up TopK, ...) have no stage II: everything before
  settling is stage I (e.g. TopK warm-up), and a run on target from its first step has empty
  stages I and II.
* **Settling time** = s_{j2} - s_1: the number of steps of stages I + II (with a log that
  starts at step 1, the steps before the settling step).
* **Which runs report one**: every run whose logged sparsity varies, whatever holds it at the
  target: ReMoE's lambda controller, or the thresholds of the penalty-free routers
  (``relu_threshold``, ``expert_threshold``: stage II then starts at the settling step). A
  router that fixes the sparsity by construction (TopK, Hash, Expert Choice) logs the same
  value every step (``Stages.fixed``): its settling step is the first step, reported as n/a.

``smooth`` > 1 first replaces S by its centred moving average over that many records (for
noisy small-batch runs whose per-step sparsity never stays inside a narrow band; centred, so
the boundaries do not lag). The defaults (:data:`SETTLE_TOL`, :data:`SMOOTH`) suit small-batch
runs; pass ``tol=0.01, smooth=1`` for the paper's large-batch curves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Stages:
    target: float
    tol: float
    window: int
    eps: float
    smooth: int
    first_step: int
    last_step: int
    stage2_start: int | None  # first step of stage II (= end of stage I, exclusive)
    settle_step: int | None  # first step of stage III
    settling_time: int | None  # settle_step - first_step (steps of stages I + II)
    #: the logged sparsity never changed (:func:`sparsity_is_fixed`): nothing to settle
    fixed: bool = False

    @property
    def reported_settle_step(self) -> int | None:
        """The settling step where there is one to report (None for a fixed sparsity)."""
        return None if self.fixed else self.settle_step

    def to_dict(self) -> dict:
        return asdict(self)

    def stage_of(self, steps: np.ndarray) -> np.ndarray:
        """1, 2 or 3 for every step (3 only once settled)."""
        out = np.ones(len(steps), dtype=np.int64)
        if self.stage2_start is not None:
            out[steps >= self.stage2_start] = 2
        if self.settle_step is not None:
            out[steps >= self.settle_step] = 3
        return out


def trailing_mean(x: np.ndarray, width: int) -> np.ndarray:
    """Mean of the last ``width`` values at each position (fewer at the start)."""
    x = np.asarray(x, dtype=np.float64)
    if width <= 1 or x.size == 0:
        return x.copy()
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - width, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def centered_mean(x: np.ndarray, width: int) -> np.ndarray:
    """Mean over ``width`` values centred on each position (truncated at the ends): no lag, so
    smoothing does not move a stage boundary."""
    x = np.asarray(x, dtype=np.float64)
    if width <= 1 or x.size == 0:
        return x.copy()
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(x.size)
    lo = np.maximum(idx - (width - 1) // 2, 0)
    hi = np.minimum(idx + width // 2 + 1, x.size)
    return (c[hi] - c[lo]) / (hi - lo)


def settle_index(sparsity: np.ndarray, target: float, tol: float, window: int) -> int | None:
    """Index j2 of the first record from which every record to the end lies within ``tol`` of
    target, if those are at least ``window`` records (else None)."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    ok = np.abs(np.asarray(sparsity, dtype=np.float64) - target) <= tol  # NaN -> False
    out = np.flatnonzero(~ok)
    j = int(out[-1]) + 1 if out.size else 0  # just after the last record out of the band
    return j if ok.size - j >= window else None


def sparsity_is_fixed(sparsity, atol: float = 1e-9) -> bool:
    """Whether every finite logged sparsity equals the first: a router that fixes k by
    construction (TopK, Hash, Expert Choice at a constant T), as opposed to one whose sparsity
    is held at the target by a controller (ReLU's lambda, the threshold routers)."""
    s = np.asarray(sparsity, dtype=np.float64)
    s = s[np.isfinite(s)]
    return bool(s.size) and bool(np.all(np.abs(s - s[0]) <= atol))


def band_excursions(steps, sparsity, target: float, tol: float) -> list[tuple[int, int]]:
    """``(first, last)`` steps of every run of records outside the band after the sparsity
    first entered it (what moves the settling step later)."""
    steps = np.asarray(steps, dtype=np.int64)
    ok = np.abs(np.asarray(sparsity, dtype=np.float64) - target) <= tol
    inside = np.flatnonzero(ok)
    if not inside.size:
        return []
    runs, start = [], None
    for i in range(int(inside[0]), ok.size):
        if not ok[i] and start is None:
            start = i
        elif ok[i] and start is not None:
            runs.append((int(steps[start]), int(steps[i - 1])))
            start = None
    if start is not None:
        runs.append((int(steps[start]), int(steps[-1])))
    return runs


#: Defaults shared by ``remoe analyze``, ``remoe report`` and the trainer's end-of-run summary.
#: A small-batch run's per-step sparsity is noisy (std ~0.02 at 2k tokens/step), so the band is
#: 0.02 wide and S is averaged over 5 steps first; the paper's 0.5M-token steps need neither.
SETTLE_TOL, SETTLE_WINDOW, STAGE_EPS, SMOOTH = 0.02, 10, 1e-3, 5


def detect_stages(steps, sparsity, target: float, reg_term=None, lm_loss=None, *,
                  tol: float = SETTLE_TOL, window: int = SETTLE_WINDOW, eps: float = STAGE_EPS,
                  smooth: int = SMOOTH) -> Stages:
    """Stage boundaries and settling time of one run (see the module docstring).

    ``reg_term``: lambda_i * L_reg,i per step and ``lm_loss``: L_lm,i (None, or no positive
    value: no adaptive regularisation, no stage II).
    """
    steps = np.asarray(steps, dtype=np.int64)
    s = centered_mean(np.asarray(sparsity, dtype=np.float64), smooth)
    if steps.size == 0:
        return Stages(target, tol, window, eps, smooth, 0, 0, None, None, None, fixed=False)
    j2 = settle_index(s, target, tol, window)
    end = j2 if j2 is not None else s.size  # stage II must start before settling
    j1 = j2
    if reg_term is not None and lm_loss is not None:
        r = np.asarray(reg_term, dtype=np.float64)[:end]
        lm = np.asarray(lm_loss, dtype=np.float64)[:end]
        with np.errstate(invalid="ignore"):
            hits = np.flatnonzero((r > 0) & (r >= eps * np.abs(lm)))
        if hits.size:
            j1 = int(hits[0])
    stage2 = int(steps[j1]) if j1 is not None else None
    settle = int(steps[j2]) if j2 is not None else None
    return Stages(
        target=float(target), tol=float(tol), window=int(window), eps=float(eps),
        smooth=int(smooth), first_step=int(steps[0]), last_step=int(steps[-1]),
        stage2_start=stage2, settle_step=settle,
        settling_time=(settle - int(steps[0])) if settle is not None else None,
        fixed=sparsity_is_fixed(sparsity),
    )


def mean_std_after(steps, values, skip: int) -> tuple[float, float, int]:
    """Mean and population std of the finite ``values`` at steps > ``skip``, and their count."""
    steps = np.asarray(steps)
    v = np.asarray(values, dtype=np.float64)
    x = v[(steps > skip) & np.isfinite(v)]
    if x.size == 0:
        return float("nan"), float("nan"), 0
    return float(x.mean()), float(x.std()), int(x.size)


def log10_span(x) -> float | None:
    """How many decades ``x`` spans: log10(max / min) of its finite positive values (None when
    there are none). The stage-III lambda amplitude of ``remoe analyze`` and ``remoe study``."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x) & (x > 0)]
    return float(np.log10(x.max() / x.min())) if x.size else None
