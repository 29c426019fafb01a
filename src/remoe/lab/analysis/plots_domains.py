"""The figure of ``remoe analyze domains``: the domain-expert MI of each run and layer against
its shuffled-label null, and the layer-mean test over the recorded steps."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from remoe.lab.analysis.plotkit import colormap, new_figure, style_axes

_MARKERS = {"topk": "s", "relu": "o"}


def run_color(i: int):
    return colormap("tab10")(i % 10)


def fig_specialisation(records: list[dict], title: str) -> Figure:
    """(a) observed MI per layer (markers) with the null's mean and 95th percentile (bars);
    (b) z of the layer-mean MI at every recorded step."""
    with_steps = any(rec["steps"] for rec in records)
    fig = new_figure(12.0 if with_steps else 7.0, 4.6)
    ax_l, ax_s = fig.subplots(1, 2) if with_steps else (fig.subplots(), None)
    n = max(len(records), 1)
    width = 0.8 / n
    for i, rec in enumerate(records):
        rows = rec["tests"]["mi"]["layers"]
        x = np.arange(len(rows)) - 0.4 + width * (i + 0.5)
        obs = [r["observed"] for r in rows]
        lo = [r["null_mean"] for r in rows]
        hi = [r["null_q95"] for r in rows]
        c = run_color(i)
        ax_l.vlines(x, lo, hi, color=c, alpha=0.45, lw=4)
        ax_l.plot(x, obs, _MARKERS.get(rec["router"], "D"), color=c, ms=6,
                  label=f"{rec['run']} (z {rec['tests']['mi']['mean']['z']:.1f})")
        if ax_s is None or not rec["steps"]:
            continue
        steps = [r["step"] for r in rec["steps"]]
        ax_s.plot(steps, [r["z"] for r in rec["steps"]], "-", marker=_MARKERS.get(
            rec["router"], "D"), ms=3, color=c, lw=1.2, label=rec["run"])
    L = max((len(r["tests"]["mi"]["layers"]) for r in records), default=1)
    ax_l.set_xticks(range(L))
    style_axes(ax_l, "domain-expert MI: observed (marker), null mean to 95th pct (bar)",
               "MoE layer", "MI (bits)")
    ax_l.legend(fontsize=7, loc="best")
    if ax_s is None:
        fig.suptitle(title, fontsize=11)
        return fig
    ax_s.axhline(0, color="0.4", lw=0.8)
    ax_s.axhline(2, color="0.4", lw=0.8, ls="--")
    style_axes(ax_s, "layer-mean MI over training: z against the null", "step",
               "z = (MI - null mean) / null std")
    ax_s.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=11)
    return fig
