"""Figures of the analyses (matplotlib, object API: no pyplot state, no display needed).

Every ``fig_*`` function returns a :class:`matplotlib.figure.Figure`; :func:`save_png` writes
it (150+ dpi) and :func:`png_bytes` returns the PNG for the HTML report.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from remoe.stages import Stages, band_excursions, centered_mean, trailing_mean
from remoe.analysis.tokens import mpl_safe

DPI = 160
STAGE_COLORS = {1: "#f4cccc", 2: "#fde9c8", 3: "#d9ead3"}
STAGE_NAMES = {1: "I dense", 2: "II sparsifying", 3: "III stable"}


def new_figure(w: float, h: float) -> Figure:
    return Figure(figsize=(w, h), layout="constrained")


def save_png(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white")
    return buf.getvalue()


def _style(ax, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None):
    if title:
        ax.set_title(title, fontsize=11)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)


def _shade_stages(ax, st: Stages | None, label: bool = False) -> None:
    if st is None or st.first_step == st.last_step == 0:
        return
    bounds = [st.first_step, st.stage2_start if st.stage2_start is not None else st.last_step,
              st.settle_step if st.settle_step is not None else st.last_step, st.last_step]
    for i, stage in enumerate((1, 2, 3)):
        a, b = bounds[i], bounds[i + 1]
        if b > a or (stage == 3 and st.settle_step is not None):
            ax.axvspan(a, max(b, a + 0.5), color=STAGE_COLORS[stage], alpha=0.6, lw=0,
                       label=f"stage {STAGE_NAMES[stage]}" if label else None, zorder=0)
    for x in (st.stage2_start, st.settle_step):
        if x is not None and x > st.first_step:
            ax.axvline(x, color="0.35", lw=0.9, ls=":", zorder=1)


def _legend(ax, *more_axes, loc="best", fontsize=8, below: bool = False, ncol: int = 3):
    """One legend for ``ax`` and its twin axes (``below``: under the axes, outside the data)."""
    handles, labels = ax.get_legend_handles_labels()
    for a in more_axes:
        h, l = a.get_legend_handles_labels()
        handles += h
        labels += l
    if not handles:
        return
    if below:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=min(len(handles), ncol), fontsize=fontsize, frameon=False)
    else:
        ax.legend(handles, labels, loc=loc, fontsize=fontsize, framealpha=0.85)


def _positive(x: np.ndarray) -> bool:
    x = x[np.isfinite(x)]
    return x.size > 0 and bool((x > 0).all())


# ----------------------------------------------------------------------------- training logs

def fig_stages(steps, sparsity, lam, reg, lm, st: Stages | None, title: str,
               lam_SL: np.ndarray | None = None) -> Figure:
    """Fig. 4: (a) S_i with target and stages, (b) lambda_i and L_reg, (c) L_lm and lambda*L_reg.

    ``lam_SL`` ([steps, L], per-layer control): each layer's lambda is drawn in (b) too."""
    fig = new_figure(15, 4.8)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    fig.suptitle(title, fontsize=12)

    _shade_stages(ax1, st, label=True)
    ax1.plot(steps, sparsity, color="C0", lw=1.0, label="sparsity $S_i$",
             alpha=0.5 if st is not None and st.smooth > 1 else 1.0)
    if st is not None and st.smooth > 1:
        ax1.plot(steps, centered_mean(np.asarray(sparsity, float), st.smooth), color="C0", lw=1.6,
                 label=f"centred mean of {st.smooth} (used for the stages)")
    if st is not None:
        ax1.axhline(st.target, color="k", ls="--", lw=0.9, label=f"target 1-k/E = {st.target:.4g}")
        ax1.axhspan(st.target - st.tol, st.target + st.tol, color="0.5", alpha=0.15, lw=0,
                    label=f"settling band ±{st.tol:g}")
        used = centered_mean(np.asarray(sparsity, float), st.smooth)
        for i, (a, b) in enumerate(band_excursions(steps, used, st.target, st.tol)):
            ax1.axvspan(a - 0.5, b + 0.5, facecolor="none", edgecolor="C3", hatch="////", lw=0,
                        alpha=0.6, zorder=0.5,
                        label="out of the band after entering it" if i == 0 else None)
        txt = (f"settling time: {st.settling_time} steps\n(in the band from step "
               f"{st.settle_step} to the end)" if st.settling_time is not None
               else "not settled\n(not in the band to the end)")
        ax1.text(0.98, 0.04, txt, transform=ax1.transAxes, ha="right", va="bottom", fontsize=9,
                 bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    _style(ax1, "(a) sparsity $S_i$", "step", "sparsity")
    _legend(ax1, below=True, ncol=2)

    _shade_stages(ax2, st)
    if lam_SL is not None and lam_SL.size and _positive(lam_SL[np.isfinite(lam_SL)]):
        for l in range(lam_SL.shape[1]):
            ax2.plot(steps, lam_SL[:, l], lw=0.8, alpha=0.8, color=plt_cmap_layers(l, lam_SL.shape[1]),
                     label=rf"$\lambda_{{i,{l}}}$ (layer {l})")
    if _positive(lam):
        label = r"$\lambda_i$" if lam_SL is None or not lam_SL.size else r"mean over layers"
        ax2.plot(steps, lam, color="C3", lw=1.0, label=label)
        ax2.set_yscale("log")
        ax2.set_ylabel(r"$\lambda_i$ (log)", color="C3")
    else:
        ax2.text(0.5, 0.6, r"no adaptive $\lambda$ (not a ReLU router)", transform=ax2.transAxes,
                 ha="center", fontsize=9, color="0.4")
        ax2.set_ylabel(r"$\lambda_i$")
    ax2b = ax2.twinx()
    ax2b.plot(steps, reg, color="C2", lw=1.0, label=r"$L_{reg}$")
    if _positive(reg):
        ax2b.set_yscale("log")
    ax2b.set_ylabel(r"$L_{reg}$", color="C2")
    _style(ax2, r"(b) coefficient $\lambda_i$ and $L_{reg}$", "step")
    _legend(ax2, ax2b, below=True)

    _shade_stages(ax3, st)
    ax3.plot(steps, lm, color="C0", lw=1.0, label=r"$L_{lm}$")
    ax3.set_ylabel(r"$L_{lm}$", color="C0")
    ax3b = ax3.twinx()
    lreg = lam * reg
    ax3b.plot(steps, lreg, color="C1", lw=1.0, label=r"$\lambda_i L_{reg}$")
    if st is not None and _positive(lam):
        ax3b.plot(steps, st.eps * np.asarray(lm, float), color="C1", lw=0.9, ls=":",
                  label=rf"$\epsilon L_{{lm}}$, $\epsilon$={st.eps:g} (stage II starts above)")
    ax3b.set_ylabel(r"$\lambda_i L_{reg}$", color="C1")
    _style(ax3, r"(c) $L_{lm}$ and $\lambda_i L_{reg}$", "step")
    _legend(ax3, ax3b, below=True, ncol=2)
    return fig


def fig_sparsity(steps, sparsity, target: float | None, skip: int, mean: float, std: float,
                 title: str) -> Figure:
    """Fig. 3: S_i at every step, target, mean ± std excluding the first ``skip`` steps."""
    fig = new_figure(7.5, 4.2)
    ax = fig.subplots()
    ax.plot(steps, sparsity, color="C0", lw=0.9, label="sparsity $S_i$ (every step)")
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=0.9, label=f"target {target:.4g}")
    if np.isfinite(mean):
        x0 = max(skip, int(steps[0])) if len(steps) else skip
        xs = [x0, int(steps[-1])]
        ax.fill_between(xs, mean - std, mean + std, color="C1", alpha=0.25, lw=0,
                        label=f"mean ± std after step {skip}: {mean:.4f} ± {std:.4f}")
        ax.plot(xs, [mean, mean], color="C1", lw=1.2)
        ax.axvline(skip, color="0.4", ls=":", lw=0.9)
        # zoom on the settled part: the dense start would squash the band
        lo = min(mean - 6 * std, target if target is not None else mean) - 0.01
        hi = max(mean + 6 * std, target if target is not None else mean) + 0.01
        inset = ax.inset_axes([0.45, 0.12, 0.5, 0.38])
        sel = np.asarray(steps) > skip
        inset.plot(np.asarray(steps)[sel], np.asarray(sparsity)[sel], color="C0", lw=0.7)
        inset.fill_between(xs, mean - std, mean + std, color="C1", alpha=0.25, lw=0)
        if target is not None:
            inset.axhline(target, color="k", ls="--", lw=0.8)
        inset.set_ylim(lo, hi)
        inset.tick_params(labelsize=7)
        inset.set_title(f"steps > {skip}", fontsize=8)
        inset.grid(True, alpha=0.3)
    _style(ax, title, "step", "sparsity")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def fig_layer_sparsity(steps, layer_SL: np.ndarray, target: float | None, skip: int,
                       mean_L: np.ndarray, std_L: np.ndarray, title: str) -> Figure:
    """Fig. 7d: per-layer sparsity over steps and its mean ± std after ``skip`` steps."""
    fig = new_figure(12, 4.2)
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
    L = layer_SL.shape[1]
    cmap = _cmap("viridis")
    for l in range(L):
        ax1.plot(steps, layer_SL[:, l], lw=0.8, color=cmap(0.85 * l / max(L - 1, 1)),
                 label=f"layer {l}")
    if target is not None:
        ax1.axhline(target, color="k", ls="--", lw=0.9, label="target")
    _style(ax1, "(a) sparsity of each MoE layer", "step", "sparsity")
    ax1.legend(fontsize=7, ncol=max(1, L // 8), loc="lower right")

    x = np.arange(L)
    ax2.errorbar(x, mean_L, yerr=std_L, fmt="o-", color="C0", capsize=3, lw=1.2, ms=4,
                 label=f"mean ± std (steps > {skip})")
    if target is not None:
        ax2.axhline(target, color="k", ls="--", lw=0.9, label=f"target {target:.4g}")
    ax2.set_xticks(x)
    _style(ax2, "(b) sparsity across layers", "layer", "sparsity")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=12)
    return fig


def fig_flips(series: dict[str, tuple[Sequence[int], Sequence[float], int]], title: str) -> Figure:
    """Appendix A: flip rate and flip count vs step; ``series``: name -> (steps, rates, N)."""
    fig = new_figure(12, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    for i, (name, (steps, rates, n)) in enumerate(series.items()):
        rates = np.asarray(rates, dtype=float)
        kw = dict(color=f"C{i}", lw=1.2, marker="o" if len(steps) <= 60 else None, ms=3)
        ax1.plot(steps, rates, label=f"{name} (N={n})", **kw)
        ax2.plot(steps, n * rates, label=f"{name} (N={n})", **kw)
    xlabel = "step (change since the previous recorded mask)"
    _style(ax1, "flip rate", xlabel, "flip rate (fraction of expert states flipped)")
    _style(ax2, "flip count", xlabel, "flip count = N × flip rate")
    for ax in (ax1, ax2):
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=12)
    return fig


def fig_curves(curves: dict[str, tuple[np.ndarray, np.ndarray]], xlabel: str, ylabel: str,
               title: str, logx: bool = False, evals: dict | None = None) -> Figure:
    """Overlaid training curves (raw faint, trailing mean bold); ``evals``: name -> (x, y)."""
    fig = new_figure(7.5, 4.4)
    ax = fig.subplots()
    lows = []
    for i, (name, (x, y)) in enumerate(curves.items()):
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = np.isfinite(x) & np.isfinite(y)
        if logx:
            ok &= x > 0
        x, y = x[ok], y[ok]
        if not x.size:
            continue
        w = max(1, x.size // 40)
        ax.plot(x, y, color=f"C{i}", lw=0.6, alpha=0.3)
        ys = trailing_mean(y, w)
        ax.plot(x, ys, color=f"C{i}", lw=1.6, label=name + (f" (mean of {w})" if w > 1 else ""))
        lows.append(np.nanmin(ys[ys.size // 10:]) if ys.size > 10 else np.nanmin(ys))
        if evals and name in evals:
            ex, ey = evals[name]
            ax.plot(ex, ey, "s", color=f"C{i}", ms=5, mec="k", mew=0.5, label=f"{name} validation")
    if logx:
        ax.set_xscale("log")
    if lows:  # focus on the informative part: the first steps' loss is off the scale
        top = max(np.nanpercentile(np.concatenate([np.asarray(c[1], float)[np.isfinite(c[1])]
                                                   for c in curves.values()]), 90), max(lows))
        ax.set_ylim(min(lows) - 0.05 * abs(min(lows)), top + 0.1 * abs(top - min(lows)) + 1e-6)
    _style(ax, title, xlabel, ylabel)
    ax.legend(fontsize=8)
    return fig


# ----------------------------------------------------------------------------- routing

def fig_routed_heatmap(ratio_LN: np.ndarray, inactive_LN: np.ndarray, threshold: float,
                       title: str) -> Figure:
    """Fig. 7b/c: layer x expert routed-tokens ratio; inactive experts white and hatched."""
    L, N = ratio_LN.shape
    fig = new_figure(min(max(5.5, 0.62 * N + 2.6), 16.0), min(max(3.2, 0.5 * L + 1.6), 14.0))
    ax = fig.subplots()
    data = np.ma.masked_where(inactive_LN, ratio_LN)
    cmap = _cmap("viridis").with_extremes(bad="white")
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
            ax.bar(x - 0.4 + width * (d + 0.5), ratio_DLN[d, l], width, color=_domain_color(d),
                   label=domains[d])
        ax.axhline(uniform, color="0.45", ls="--", lw=1.0, label=f"uniform k/E = {uniform:.3g}")
        _style(ax, None, None, f"layer {l}\nrouted ratio")
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
        ax.plot(x, active_DL[d], "o-", color=_domain_color(d), lw=1.4, ms=4, label=domains[d])
    ax.plot(x, overall_L, "-", color="k", lw=2.4, alpha=0.6, label="all domains")
    ax.axhline(k, color="0.45", ls="--", lw=1.0, label=f"k·G = {k:g}")
    ax.set_xticks(x)
    _style(ax, title, "layer", "mean active experts per token")
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
    _style(ax, f"{title}  (Spearman ρ(frequency, active experts) = {rho:.3f})",
           f"tokens sorted by mean active experts ({n} tokens)")
    note_ax.text(0.0, 0.5, "most experts: " + ", ".join(top) + "\nfewest experts: " +
                 ", ".join(bottom), transform=note_ax.transAxes, fontsize=7.5, va="center",
                 ha="left", bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    _legend(ax, ax2, loc="upper right")
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
        cells = [f"{mpl_safe(_clip(names(it['token_id'])))} {100 * it['share']:.1f}% "
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


def plt_cmap_layers(l: int, L: int):
    """A colour per layer, from light (first) to dark (last)."""
    return _cmap("viridis")(0.15 + 0.7 * l / max(1, L - 1))


def _clip(s: str, n: int = 14) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def _domain_color(d: int):
    return _cmap("tab10")(d % 10) if d < 10 else _cmap("tab20")(d % 20)
