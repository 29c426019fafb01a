"""Analyses of ReMoE runs (paper §3.5, §5, Appendices A, B, G, H) and the HTML report.

``remoe analyze`` (:mod:`remoe.analysis.cli`) and ``remoe report``
(:mod:`remoe.analysis.report_cli`); definitions in docs/ANALYSIS.md. The pure functions:
:func:`detect_stages` (stages + settling time), :func:`flip_rate` / :func:`flip_series`
(routing stability), :func:`collect_routing_stats` -> :class:`RoutingStats` (routed-token
ratios, domain specialisation, dynamic allocation, top tokens per expert).
"""

from remoe.analysis.flips import FlipSeries, flip_rate, flip_series
from remoe.analysis.routing import RoutingStats, collect_routing_stats
from remoe.analysis.runlog import Run, load_masks
from remoe.stages import Stages, detect_stages

__all__ = ["FlipSeries", "RoutingStats", "Run", "Stages", "collect_routing_stats",
           "detect_stages", "flip_rate", "flip_series", "load_masks"]
