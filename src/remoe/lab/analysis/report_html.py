"""The HTML pieces of ``remoe report``: the style sheet, escaping, number formatting, embedded
PNG figures and tables; and for the studies' results the markdown table (:func:`md_table`) and
number cells (:func:`num`)."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

import numpy as np

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1250px;
color:#222;line-height:1.45;padding:0 1em}
h1{border-bottom:2px solid #444}h2{border-bottom:1px solid #bbb;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0 1.2em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f0f0f0}td.l,th.l{text-align:left}
td.best{font-weight:bold;background:#e6f2e6}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
figure{margin:1em 0}figcaption{font-size:.88em;color:#555}
.note{color:#666;font-size:.9em}pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.85em}
nav a{margin-right:1em}
"""


def esc(x: Any) -> str:
    return html.escape(str(x))


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}" if abs(v) < 1e9 else f"{float(v):.3e}"
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v):
            return "–"
        a = abs(v)
        if float(v).is_integer() and 1000 <= a < 1e9:
            return f"{int(v):,}"
        if a != 0 and (a >= 1e5 or a < 1e-3):
            return f"{v:.3e}"
        return f"{v:.{digits}f}"
    return esc(v)


def img(png: bytes | Path, caption: str = "") -> str:
    data = png.read_bytes() if isinstance(png, Path) else png
    b64 = base64.b64encode(data).decode("ascii")
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure><img src="data:image/png;base64,{b64}" alt="{esc(caption)}">{cap}</figure>'


def table(head: list[str], rows: list[list[Any]], left: int = 1,
          best: dict[int, str] | None = None, digits: int = 4) -> str:
    """HTML table; the first ``left`` columns are left-aligned text (already HTML); ``best``:
    column -> "min"/"max" marks the best numeric cell of that column."""
    best = best or {}
    marks: dict[int, float] = {}
    for c, how in best.items():
        vals = [r[c] for r in rows if isinstance(r[c], (int, float)) and math.isfinite(r[c])]
        if len(vals) > 1:
            marks[c] = min(vals) if how == "min" else max(vals)
    out = ["<table><tr>" + "".join(f'<th class="{"l" if i < left else ""}">{esc(h)}</th>'
                                   for i, h in enumerate(head)) + "</tr>"]
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            cls = "l" if i < left else ""
            if i in marks and isinstance(v, (int, float)) and v == marks[i]:
                cls += " best"
            cells.append(f'<td class="{cls.strip()}">{v if i < left else fmt(v, digits)}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def md_table(head: list[str], body: list[list[str]]) -> list[str]:
    """The lines of a markdown table: ``head``, then one row per ``body`` entry (cells as text)."""
    return (["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
            + ["| " + " | ".join(r) + " |" for r in body])


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(v: Any, spec: str) -> str:
    """``v`` formatted by ``spec`` where it :func:`is_number`, else "–" (the study's tables)."""
    return format(v, spec) if is_number(v) else "–"
