"""One self-contained HTML report of one or several runs (figures embedded as base64 PNG).

For every run :func:`remoe.lab.analysis.analyze.analyze` is run first (its files land in the run's
``analysis/`` directory, the routing statistics are cached there), then the page is assembled:
a comparison section (summary table, LM loss vs step and vs FLOPs, validation loss per domain,
flip rates, zero-shot accuracies from ``eval_results.json``) and one section per run (config,
losses, sparsity / lambda / stages, settling time, per-domain validation loss, routing figures,
specialisation number).

Parts: :mod:`remoe.lab.analysis.report_html` (HTML pieces), :mod:`remoe.lab.analysis.report_facts`
(what is read from a run), :mod:`remoe.lab.analysis.report_sections` (the sections); this module
assembles the page.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, replace
from pathlib import Path

from remoe.lab.analysis.analyze import Options, analyze
from remoe.lab.analysis.report_facts import zero_shot  # noqa: F401 (imported from here too)
from remoe.lab.analysis.report_html import CSS, esc, fmt, table  # noqa: F401 (fmt, table)
from remoe.lab.analysis.report_sections import comparison_section, run_section
from remoe.lab.analysis.runlog import Run


@dataclass
class ReportOptions:
    analysis: Options
    title: str = "remoe report"
    analysis_root: Path | None = None  # run X is analysed into analysis_root/X (default X/analysis)
    extra_html: tuple[str, ...] = ()  # sections placed after the comparison (e.g. a study's curves)


def build_report(run_paths: list[str], opts: ReportOptions, log=print) -> str:
    runs = [Run(p) for p in run_paths]
    names: list[str] = []
    for r in runs:
        n, i = r.name, 2
        while n in names:
            n, i = f"{r.name} ({i})", i + 1
        names.append(n)
    results, outs = [], []
    for r, n in zip(runs, names):
        out = (opts.analysis_root / _slug(n)) if opts.analysis_root else r.path / "analysis"
        log(f"analysing {r.path} -> {out}")
        results.append(analyze(r, out, replace(opts.analysis, compare=[]), log=log, reuse=True))
        outs.append(out)
    anchors = [f"run-{i}" for i in range(len(runs))]
    nav = "<nav>" + '<a href="#compare">comparison</a>' + "".join(
        f'<a href="#{a}">{esc(n)}</a>' for a, n in zip(anchors, names)) + "</nav>"
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [f"<h1>{esc(opts.title)}</h1>",
            f'<p class="note">Generated {when} by <code>remoe report</code> from '
            f"{len(runs)} run(s). Definitions: docs/ANALYSIS.md.</p>", nav,
            comparison_section(runs, names, results, outs), *opts.extra_html]
    body += [run_section(r, n, a, res, o)
             for r, n, a, res, o in zip(runs, names, anchors, results, outs)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(opts.title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
