"""Shared pieces of the analysis figures: figure creation and PNG output, axis style, stage
shading, legends and colours (matplotlib object API: no pyplot state, no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from remoe.method.stages import Stages

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
