"""Figures of the analyses (matplotlib, object API: no pyplot state, no display needed).

Every ``fig_*`` function returns a :class:`matplotlib.figure.Figure`; :func:`save_png` writes
it (150+ dpi) and :func:`png_bytes` returns the PNG for the HTML report. This module holds the
shared pieces (figure creation and PNG output, axis style, stage shading, legends, colours) and
draws the training-log figures; the routing figures live in
:mod:`remoe.lab.analysis.plots_routing`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from remoe.method.stages import Stages, band_excursions, centered_mean, trailing_mean

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


def style_axes(ax, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None):
    if title:
        ax.set_title(title, fontsize=11)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)


def shade_stages(ax, st: Stages | None, label: bool = False) -> None:
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


def legend(ax, *more_axes, loc="best", fontsize=8, below: bool = False, ncol: int = 3):
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


def positive(x: np.ndarray) -> bool:
    x = x[np.isfinite(x)]
    return x.size > 0 and bool((x > 0).all())


def layer_color(l: int, L: int):
    """A colour per layer, from light (first) to dark (last)."""
    return colormap("viridis")(0.15 + 0.7 * l / max(1, L - 1))


def clip(s: str, n: int = 14) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def colormap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def domain_color(d: int):
    return colormap("tab10")(d % 10) if d < 10 else colormap("tab20")(d % 20)


def mpl_safe(s: str) -> str:
    """Escape matplotlib mathtext (``$``) so token strings render literally."""
    return s.replace("$", r"\$")


# ----------------------------------------------------------------------------- training logs

def fig_stages(steps, sparsity, lam, reg, lm, st: Stages | None, title: str,
               lam_SL: np.ndarray | None = None) -> Figure:
    """Fig. 4: (a) S_i with target and stages, (b) lambda_i and L_reg, (c) L_lm and lambda*L_reg.

    ``lam_SL`` ([steps, L], per-layer control): each layer's lambda is drawn in (b) too."""
    fig = new_figure(15, 4.8)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    fig.suptitle(title, fontsize=12)

    shade_stages(ax1, st, label=True)
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
    style_axes(ax1, "(a) sparsity $S_i$", "step", "sparsity")
    legend(ax1, below=True, ncol=2)

    shade_stages(ax2, st)
    if lam_SL is not None and lam_SL.size and positive(lam_SL[np.isfinite(lam_SL)]):
        for l in range(lam_SL.shape[1]):
            ax2.plot(steps, lam_SL[:, l], lw=0.8, alpha=0.8, color=layer_color(l, lam_SL.shape[1]),
                     label=rf"$\lambda_{{i,{l}}}$ (layer {l})")
    if positive(lam):
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
    if positive(reg):
        ax2b.set_yscale("log")
    ax2b.set_ylabel(r"$L_{reg}$", color="C2")
    style_axes(ax2, r"(b) coefficient $\lambda_i$ and $L_{reg}$", "step")
    legend(ax2, ax2b, below=True)

    shade_stages(ax3, st)
    ax3.plot(steps, lm, color="C0", lw=1.0, label=r"$L_{lm}$")
    ax3.set_ylabel(r"$L_{lm}$", color="C0")
    ax3b = ax3.twinx()
    lreg = lam * reg
    ax3b.plot(steps, lreg, color="C1", lw=1.0, label=r"$\lambda_i L_{reg}$")
    if st is not None and positive(lam):
        ax3b.plot(steps, st.eps * np.asarray(lm, float), color="C1", lw=0.9, ls=":",
                  label=rf"$\epsilon L_{{lm}}$, $\epsilon$={st.eps:g} (stage II starts above)")
    ax3b.set_ylabel(r"$\lambda_i L_{reg}$", color="C1")
    style_axes(ax3, r"(c) $L_{lm}$ and $\lambda_i L_{reg}$", "step")
    legend(ax3, ax3b, below=True, ncol=2)
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
    style_axes(ax, title, "step", "sparsity")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def fig_layer_sparsity(steps, layer_SL: np.ndarray, target: float | None, skip: int,
                       mean_L: np.ndarray, std_L: np.ndarray, title: str) -> Figure:
    """Fig. 7d: per-layer sparsity over steps and its mean ± std after ``skip`` steps."""
    fig = new_figure(12, 4.2)
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
    L = layer_SL.shape[1]
    cmap = colormap("viridis")
    for l in range(L):
        ax1.plot(steps, layer_SL[:, l], lw=0.8, color=cmap(0.85 * l / max(L - 1, 1)),
                 label=f"layer {l}")
    if target is not None:
        ax1.axhline(target, color="k", ls="--", lw=0.9, label="target")
    style_axes(ax1, "(a) sparsity of each MoE layer", "step", "sparsity")
    ax1.legend(fontsize=7, ncol=max(1, L // 8), loc="lower right")

    x = np.arange(L)
    ax2.errorbar(x, mean_L, yerr=std_L, fmt="o-", color="C0", capsize=3, lw=1.2, ms=4,
                 label=f"mean ± std (steps > {skip})")
    if target is not None:
        ax2.axhline(target, color="k", ls="--", lw=0.9, label=f"target {target:.4g}")
    ax2.set_xticks(x)
    style_axes(ax2, "(b) sparsity across layers", "layer", "sparsity")
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
    style_axes(ax1, "flip rate", xlabel, "flip rate (fraction of expert states flipped)")
    style_axes(ax2, "flip count", xlabel, "flip count = N × flip rate")
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
    style_axes(ax, title, xlabel, ylabel)
    ax.legend(fontsize=8)
    return fig
