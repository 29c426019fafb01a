"""Analyses of ReMoE runs (paper §3.5, §5, Appendices A, B, G, H) and the HTML report.

``remoe analyze`` (:mod:`remoe.lab.analysis.cli`) and ``remoe report``
(:mod:`remoe.lab.analysis.report_cli`); definitions in docs/ANALYSIS.md. The pure functions:
:func:`detect_stages` (stages + settling time), :func:`flip_rate` / :func:`flip_series`
(routing stability), :func:`collect_routing_stats` -> :class:`RoutingStats` (routed-token
ratios, domain specialisation, dynamic allocation, top tokens per expert).
"""

from remoe.lazy import lazy_names

# public name -> its module, imported on first use (PEP 562): `remoe analyze --help` and
# `remoe report --help` must not import torch
_LAZY = {"FlipSeries": "remoe.lab.analysis.analyze", "flip_rate": "remoe.lab.analysis.analyze",
         "flip_series": "remoe.lab.analysis.analyze", "RoutingStats": "remoe.lab.analysis.routing",
         "collect_routing_stats": "remoe.lab.analysis.routing", "Run": "remoe.lab.analysis.runlog",
         "load_masks": "remoe.lab.analysis.runlog", "Stages": "remoe.method.stages",
         "detect_stages": "remoe.method.stages"}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
