"""Learning curves of a study: validation loss against tokens and training FLOPs.

Per finished run (:func:`run_curve`): every record of ``eval.jsonl`` (the trainer's periodic
validation on its fixed sample, ``train.eval_chunks_per_domain`` sequences per domain) with the
tokens it was taken at and the training FLOPs spent by then (``metrics.jsonl``'s cumulative
``flops`` at that step). Per label (:func:`label_curves`): the mean over its seeds at the
evaluation steps they share, and the seeds' range (the shaded band of the figure).

Crossover rule (:func:`crossover`): run A *stays below* run B from the first evaluation of A
after which every later evaluation of A is below B's loss at the same tokens (or FLOPs: B's
curve linearly interpolated at A's FLOPs; points outside B's range are not compared). A is
below B from the start when that is A's first comparable evaluation; never when A's last
comparable evaluation is not below B.

Outputs (:func:`write_curves`): ``curves.csv`` (one row per run and evaluation),
``curves.png`` (two panels: against tokens and against FLOPs, seed bands shaded) and the
markdown of :func:`markdown_section` (the loss at each evaluation per label, the pairwise
crossover table, the gap at matched FLOPs).
"""

from __future__ import annotations

import csv
import io
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remoe.fileio import atomic_open, atomic_write_text
from remoe.lab.analysis.report_html import md_table


@dataclass
class Curve:
    """Validation loss of one run (``name``) or one label's seed mean (``seeds`` > 1)."""

    label: str
    step: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    val_loss: np.ndarray
    low: np.ndarray | None = None   # seed range (labels)
    high: np.ndarray | None = None
    seeds: int = 1

    def x(self, axis: str) -> np.ndarray:
        return self.tokens if axis == "tokens" else self.flops


def run_curve(run_dir, label: str = "") -> Curve | None:
    """The validation curve of one run (a Run or its directory; None without evaluations)."""
    from remoe.lab.analysis.runlog import as_run

    run = as_run(run_dir)
    evals = [e for e in run.evals if isinstance(e.get("val_loss"), (int, float))]
    if not evals:
        return None
    step = np.asarray([int(e["step"]) for e in evals], dtype=np.int64)
    tokens = np.asarray([float(e.get("tokens") or 0.0) for e in evals])
    m = run.metrics
    if len(m) and m.has("flops"):
        ok = np.isfinite(m["flops"])
        flops = np.interp(step, m.steps[ok], m["flops"][ok])
    else:
        flops = np.full(step.shape, np.nan)
    loss = np.asarray([float(e["val_loss"]) for e in evals])
    return Curve(label or run.name, step, tokens, flops, loss)


def label_curve(label: str, curves: list[Curve]) -> Curve | None:
    """Seed mean (and range) over the evaluation steps every seed has."""
    curves = [c for c in curves if c is not None and c.step.size]
    if not curves:
        return None
    common = sorted(set.intersection(*(set(c.step.tolist()) for c in curves)))
    if not common:
        return None

    def at(c: Curve, arr: np.ndarray) -> np.ndarray:
        idx = {s: i for i, s in enumerate(c.step.tolist())}
        return np.asarray([arr[idx[s]] for s in common])

    loss = np.stack([at(c, c.val_loss) for c in curves])
    return Curve(label, np.asarray(common), np.mean([at(c, c.tokens) for c in curves], axis=0),
                 np.mean([at(c, c.flops) for c in curves], axis=0), loss.mean(axis=0),
                 loss.min(axis=0), loss.max(axis=0), len(curves))


def crossover(a: Curve, b: Curve, axis: str = "tokens") -> dict[str, Any] | None:
    """When A stays below B (module docstring): ``{"index", "step", "x", "from_start",
    "never", "gap_end", "compared"}``; None when no evaluation of A falls in B's range."""
    xa, xb = a.x(axis), b.x(axis)
    ok = np.isfinite(xa) & (xa >= np.nanmin(xb)) & (xa <= np.nanmax(xb))
    if not ok.any() or not np.isfinite(xb).all():
        return None
    idx = np.flatnonzero(ok)
    order = np.argsort(xb)
    diff = a.val_loss[idx] - np.interp(xa[idx], xb[order], b.val_loss[order])
    below = diff < 0
    out: dict[str, Any] = {"compared": int(idx.size), "gap_end": float(diff[-1]),
                           "never": not bool(below[-1]), "from_start": False,
                           "index": None, "step": None, "x": None}
    if below[-1]:
        # the first position after which every comparison is below
        first = int(idx.size) - int(np.argmin(below[::-1])) if not below.all() else 0
        i = int(idx[first])
        out.update(index=i, step=int(a.step[i]), x=float(xa[i]), from_start=first == 0)
    return out


def collect_curves(rows: list[dict[str, Any]], run_path) -> tuple[list[Curve], list[Curve]]:
    """(per-run curves, per-label seed-mean curves) of the finished rows; ``run_path(row)``
    gives the directory a row's run lives in."""
    runs: list[Curve] = []
    by_label: dict[str, list[Curve]] = {}
    groups_of: dict[str, set] = {}
    for row in rows:
        groups_of.setdefault(row["label"], set()).add(row.get("group"))
    for row in rows:
        if row.get("state") != "done":
            continue
        c = run_curve(run_path(row), row["name"])
        if c is None:
            continue
        runs.append(c)
        # a label used by two groups is told apart by its group
        key = row["label"] if len(groups_of[row["label"]]) == 1 else f"{row['group']}/{row['label']}"
        by_label.setdefault(key, []).append(c)
    labels = [lc for k, cs in by_label.items() if (lc := label_curve(k, cs)) is not None]
    return runs, labels


def write_csv(path: Path, runs: list[Curve]) -> Path:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["run", "step", "tokens", "flops", "val_loss"])
    for c in runs:
        for i in range(c.step.size):
            w.writerow([c.label, int(c.step[i]), f"{c.tokens[i]:.0f}", f"{c.flops[i]:.6g}",
                        f"{c.val_loss[i]:.6f}"])
    atomic_write_text(path, buf.getvalue())
    return path


def figure(labels: list[Curve]):
    """Two panels (tokens, FLOPs): each label's seed mean, its seed range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, axis, name in ((axes[0], "tokens", "tokens"), (axes[1], "flops", "training FLOPs")):
        for c in labels:
            x = c.x(axis)
            line, = ax.plot(x, c.val_loss, marker=".", lw=1.2,
                            label=f"{c.label} (n={c.seeds})")
            if c.seeds > 1 and c.low is not None:
                ax.fill_between(x, c.low, c.high, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (fixed sample)")
    lo = min(float(np.min(c.val_loss)) for c in labels)
    hi = max(float(np.percentile(c.val_loss, 90)) for c in labels)
    if hi > lo:  # the early, steep part of the curves would flatten the rest
        axes[0].set_ylim(lo - 0.05 * (hi - lo), hi)
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle("validation loss; shaded: range over seeds", fontsize=10)
    fig.tight_layout()
    return fig


def write_figure(path: Path, labels: list[Curve]) -> Path | None:
    if not labels:
        return None
    import matplotlib.pyplot as plt

    fig = figure(labels)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


def _fmt_x(v: float | None, axis: str) -> str:
    if v is None:
        return "–"
    return f"{v / 1e6:.2f}M tok" if axis == "tokens" else f"{v:.3g} FLOPs"


def _when(c: dict[str, Any] | None, axis: str) -> str:
    if c is None:
        return "not comparable"
    if c["never"]:
        return "never"
    start = " (from the first evaluation)" if c["from_start"] else ""
    return f"step {c['step']} ({_fmt_x(c['x'], axis)}){start}"


def markdown_section(labels: list[Curve]) -> list[str]:
    """Loss at each evaluation per label, and the pairwise crossovers."""
    if not labels:
        return []
    steps = sorted(set().union(*(set(c.step.tolist()) for c in labels)))
    if len(steps) > 13:  # at most ~12 columns: every other evaluation, always the last
        keep = steps[1::max(1, len(steps) // 12)]
        steps = sorted(set(keep) | {steps[-1]})
    lines = ["## Learning curves", "",
             "Validation loss on the trainer's fixed sample (`train.eval_chunks_per_domain` "
             "sequences per domain), mean over seeds (n), at each evaluation step. "
             "Figure: `curves.png`; every point: `curves.csv`.", ""]
    head = ["run", "n"] + [str(s) for s in steps]
    body = []
    for c in labels:
        idx = {s: i for i, s in enumerate(c.step.tolist())}
        body.append([f"`{c.label}`", str(c.seeds)]
                    + [f"{c.val_loss[idx[s]]:.3f}" if s in idx else "–" for s in steps])
    lines += md_table(head, body) + [""]
    lines += ["Crossovers: the first evaluation after which the row's run stays below the "
              "other (seed means; at matched tokens, and at matched training FLOPs with the "
              "other's curve interpolated). Gap: the row's loss minus the other's at the row's "
              "last comparable evaluation (negative: the row is lower).", ""]
    head = ["A", "B", "A below B from (tokens)", "gap at end (tokens)",
            "A below B from (FLOPs)", "gap at end (FLOPs)"]
    body = []
    for a, b in itertools.combinations(labels, 2):
        ta = crossover(a, b, "tokens")
        if ta is not None and ta["never"]:  # orient each pair so that A is the one ahead
            a, b = b, a
            ta = crossover(a, b, "tokens")
        fa = crossover(a, b, "flops")
        body.append([f"`{a.label}`", f"`{b.label}`", _when(ta, "tokens"),
                     f"{ta['gap_end']:+.3f}" if ta else "–", _when(fa, "flops"),
                     f"{fa['gap_end']:+.3f}" if fa else "–"])
    lines += md_table(head, body) + [""]
    return lines
