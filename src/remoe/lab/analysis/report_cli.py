"""``remoe report RUN [RUN ...] --out report.html``: one self-contained HTML report.

Each run is analysed first (``remoe analyze`` with the same options; files in RUN/analysis/),
then the page compares the runs (summary table, LM loss vs step and vs FLOPs, validation loss
per domain, flip rates, zero-shot accuracies) and shows every run's figures. See
docs/ANALYSIS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from remoe.lab.analysis.cli import add_analysis_options, options_from_args
from remoe.lab.analysis.common import ANALYSES, MODEL_ANALYSES  # light: fast `remoe report --help`
from remoe.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--title", default=None, help="page title")
    p.add_argument("--analysis-out", default=None,
                   help="write each run's analysis files to DIR/<run name> instead of RUN/analysis")
    p.add_argument("--no-model", action="store_true",
                   help="skip the model-based analyses (no checkpoint loading, no forward pass)")
    add_analysis_options(p, checkpoint=False)


def run(args) -> int:
    from remoe.lab.analysis.report import ReportOptions, build_report
    from remoe.machine.threads import fix_threads

    what = tuple(a for a in ANALYSES if not (args.no_model and a in MODEL_ANALYSES))
    opts = options_from_args(args, what, [])
    out = Path(args.out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"--out={args.out!r} must be an .html file")
    fix_threads("remoe report")  # the training policy: all usable cores, fixed; a load hint
    title = args.title or ("remoe report: " + ", ".join(Path(r).name for r in args.runs))
    html = build_report(args.runs, ReportOptions(
        analysis=opts, title=title,
        analysis_root=Path(args.analysis_out) if args.analysis_out else None))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0
