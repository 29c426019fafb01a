"""Routing figures (paper Figs. 7-8 and Appendix E): routed-token heatmaps, domain
specialisation, token- and domain-level allocation, each expert's top tokens; and the figure of
``remoe analyze domains`` (:func:`fig_specialisation`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from remoe.lab.analysis.plots import (clip, colormap, domain_color, legend, mpl_safe, new_figure,
                                      style_axes)

_MARKERS = {"topk": "s", "relu": "o"}


def fig_routed_heatmap(ratio_LN: np.ndarray, inactive_LN: np.ndarray, threshold: float,
                       title: str) -> Figure:
    """Fig. 7b/c: layer x expert routed-tokens ratio; inactive experts white and hatched."""
    L, N = ratio_LN.shape
    fig = new_figure(min(max(5.5, 0.62 * N + 2.6), 16.0), min(max(3.2, 0.5 * L + 1.6), 14.0))
    ax = fig.subplots()
    data = np.ma.masked_where(inactive_LN, ratio_LN)
    cmap = colormap("viridis").with_extremes(bad="white")
    vmax = max(float(ratio_LN.max()), 1e-9)
    im = ax.imshow(data, cmap=cmap, vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
    for l, e in zip(*np.nonzero(inactive_LN)):
        ax.add_patch(Rectangle((e - 0.5, l - 0.5), 1, 1, fill=False, hatch="///",
                               edgecolor="0.55", lw=0))
    if N <= 16 and L <= 24:
        for l in range(L):
            for e in range(N):
                v = ratio_LN[l, e]
                dark = not inactive_LN[l, e] and v < 0.6 * vmax
                ax.text(e, l, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    ax.set_xticks(range(N))
    ax.set_yticks(range(L))
    if N > 24:
        ax.set_xticks(range(0, N, max(1, N // 16)))
    ax.set_xticks(np.arange(-0.5, N, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, L, 1), minor=True)
    ax.grid(which="minor", color="white", lw=0.6)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=11)
    cb = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    cb.set_label("routed tokens ratio")
    fig.legend(handles=[Patch(facecolor="white", edgecolor="0.55", hatch="///",
                              label=f"inactive (< 1/{round(1 / threshold)} of tokens)")],
               loc="outside lower center", fontsize=8, frameon=False)
    return fig


def fig_specialization(ratio_DLN: np.ndarray, domains: list[str], layers: list[int],
                       uniform: float, title: str) -> Figure:
    """Fig. 8: routed-tokens ratio per expert and domain for the chosen layers."""
    Dm, L, N = ratio_DLN.shape
    fig = new_figure(min(max(8.0, 0.09 * N * Dm + 0.5 * N + 2.5), 18.0), 2.5 * len(layers) + 1.0)
    axes = np.atleast_1d(fig.subplots(len(layers), 1, sharex=True, squeeze=False)[:, 0])
    width = 0.8 / max(Dm, 1)
    x = np.arange(N)
    for ax, l in zip(axes, layers):
        for d in range(Dm):
            ax.bar(x - 0.4 + width * (d + 0.5), ratio_DLN[d, l], width, color=domain_color(d),
                   label=domains[d])
        ax.axhline(uniform, color="0.45", ls="--", lw=1.0, label=f"uniform k/E = {uniform:.3g}")
        style_axes(ax, None, None, f"layer {l}\nrouted ratio")
        ax.set_xlim(-0.6, N - 0.4)
    axes[-1].set_xticks(x)
    axes[-1].set_xlabel("expert")
    h, lab = axes[0].get_legend_handles_labels()
    fig.legend(h, lab, loc="outside lower center", ncol=min(len(lab), 8), fontsize=8)
    fig.suptitle(title, fontsize=12)
    return fig


def fig_domain_allocation(active_DL: np.ndarray, overall_L: np.ndarray, domains: list[str],
                          k: float, title: str) -> Figure:
    """App. H: mean active experts per token of each domain, across layers."""
    Dm, L = active_DL.shape
    fig = new_figure(min(max(7.0, 0.45 * L + 4), 14.0), 4.4)
    ax = fig.subplots()
    x = np.arange(L)
    for d in range(Dm):
        ax.plot(x, active_DL[d], "o-", color=domain_color(d), lw=1.4, ms=4, label=domains[d])
    ax.plot(x, overall_L, "-", color="k", lw=2.4, alpha=0.6, label="all domains")
    ax.axhline(k, color="0.45", ls="--", lw=1.0, label=f"k·G = {k:g}")
    ax.set_xticks(x)
    style_axes(ax, title, "layer", "mean active experts per token")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="outside right upper")
    return fig


def fig_token_allocation(table: dict[str, np.ndarray], names: Callable[[int], str],
                         rho: float, k: float, title: str, annotate: int = 5) -> Figure:
    """Fig. 6: tokens sorted by mean active experts; their frequency (log scale) alongside."""
    fig = new_figure(10, 5.0)
    # the token examples go in a row of their own under the plot: inside the axes the twin
    # axes' scatter points would be drawn over them
    ax, note_ax = fig.subplots(2, 1, height_ratios=[1, 0.12])
    note_ax.axis("off")
    n = table["token_id"].size
    x = np.arange(n)
    ax.plot(x, table["mean_active"], color="C0", lw=1.8, label="mean active experts (left)")
    ax.axhline(k, color="C0", ls="--", lw=0.8, alpha=0.7, label=f"k·G = {k:g}")
    ax.set_ylabel("mean active experts per token", color="C0")
    ax2 = ax.twinx()
    freq = table["frequency"]
    ax2.scatter(x, freq, s=6, color="C1", alpha=0.35, lw=0, label="token frequency (right, log)")
    if n >= 20:
        w = max(5, n // 25)
        logf = np.log10(np.maximum(freq, 1e-300))
        smooth = np.convolve(logf, np.ones(w) / w, mode="same")
        edge = w // 2
        ax2.plot(x[edge:n - edge], 10 ** smooth[edge:n - edge], color="C1", lw=1.6,
                 label=f"frequency, geometric mean of {w}")
    ax2.set_yscale("log")
    ax2.set_ylabel("token frequency (log)", color="C1")
    top = [f"{mpl_safe(names(int(table['token_id'][i])))} ({table['mean_active'][i]:.2f})"
           for i in range(min(annotate, n))]
    bottom = [f"{mpl_safe(names(int(table['token_id'][i])))} ({table['mean_active'][i]:.2f})"
              for i in range(max(n - annotate, 0), n)]
    style_axes(ax, f"{title}  (Spearman ρ(frequency, active experts) = {rho:.3f})",
           f"tokens sorted by mean active experts ({n} tokens)")
    note_ax.text(0.0, 0.5, "most experts: " + ", ".join(top) + "\nfewest experts: " +
                 ", ".join(bottom), transform=note_ax.transAxes, fontsize=7.5, va="center",
                 ha="left", bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    legend(ax, ax2, loc="upper right")
    return fig


def fig_top_tokens(per_expert: list[list[dict]], layer: int, names: Callable[[int], str],
                   title: str, top: int = 8, expert_ratio: Sequence[float] | None = None,
                   note: str | None = None) -> Figure:
    """Table 10 as a figure: per expert, the tokens most over-represented among its tokens
    (:meth:`RoutingStats.top_tokens`), each with its share of the expert's tokens and its lift
    over the token's base frequency; ``expert_ratio``: P(e), shown beside each expert."""
    N = len(per_expert)
    rows = []
    for e, items in enumerate(per_expert):
        cells = [f"{mpl_safe(clip(names(it['token_id'])))} {100 * it['share']:.1f}% "
                 f"×{it['lift']:.1f}" for it in items[:top]]
        label = str(e) if expert_ratio is None else f"{e} ({100 * expert_ratio[e]:.0f}%)"
        empty = ("(none: takes tokens in proportion to their frequency)"
                 if expert_ratio is None or expert_ratio[e] > 0 else "(no token routed)")
        rows.append([label, "; ".join(cells) if cells else empty])
    fig = new_figure(13, 0.3 * (N + 1) + 0.7 + (0.25 if note else 0))
    ax = fig.subplots()
    ax.axis("off")
    head0 = "expert" if expert_ratio is None else "expert (P(e))"
    tab = ax.table(cellText=rows, colLabels=[head0, f"layer {layer}: over-represented tokens — "
                                             "share of the expert's tokens P(v|e), "
                                             "×lift = P(v|e) / P(v)"],
                   colWidths=[0.1, 0.9], cellLoc="left", bbox=[0, 0, 1, 1])
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    for (r, c), cell in tab.get_celld().items():
        cell.PAD = 0.01 if c == 1 else 0.05
        if r == 0:
            cell.set_text_props(weight="bold")
            cell.set_facecolor("#e8e8e8")
        if c == 0:
            cell.get_text().set_horizontalalignment("center")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    return fig


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
        c = colormap("tab10")(i % 10)
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
