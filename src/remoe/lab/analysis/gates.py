"""``gates``: how large the router's gates are and how much each FFN moves the residual stream.

One forward pass over evaluation tokens, with hooks and no change to the model. Per layer:

* ``ffn_rel``: mean over tokens of ``||y_t|| / ||h_t||``, the FFN block's output against the
  residual stream it is added to (``h`` = the input of ``ffn_norm``). Every FFN kind has it.
* token routers only (``gates_TN``/``mask_TN`` of :class:`remoe.model.routers.Routing`):
  ``gate_sum`` (mean of sum_n gates_TN[t, n], with its 10th/90th percentiles): the factor the
  experts' outputs are scaled by on a token; ``gate_active`` (mean gate of an active pair);
  ``active`` (mean active experts per token).

Why it is here: a TopK router without renormalisation (paper eq. 2) scales a token's single
expert by its softmax probability, about 1/E at initialisation, while a dense FFN is scaled by
1 and a ReLU gate learns its own scale. Comparing ``gate_sum`` and ``ffn_rel`` of dense, TopK
and ReMoE runs (``--compare``) shows whether a MoE's FFNs are muted (docs/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from remoe.lab.analysis import plots
from remoe.lab.analysis.common import Options, Skip, write_csv, write_json
from remoe.lab.analysis.model_analyses import model_and_tokens
from remoe.lab.analysis.runlog import Run


def gate_stats(model: torch.nn.Module, batches, max_tokens: int | None = None,
               seq_len: int | None = None) -> list[dict[str, Any]]:
    """The per-layer numbers of the module docstring for ``model`` over ``batches`` of
    ``(input_ids [B, S], ...)``."""
    from remoe.model.routers import Router

    layers = list(model.layers)
    sums: list[dict[str, Any]] = [{"rel": [], "gate_sum": [], "gate_active": [], "active": []}
                                  for _ in layers]
    held: dict[int, torch.Tensor] = {}
    hooks = []

    def keep_h(l):
        def hook(_mod, args):
            held[l] = args[0].detach()
        return hook

    def ffn_out(l):
        def hook(_mod, _args, out):
            y = (out[0] if isinstance(out, tuple) else out).detach().float()
            h = held.pop(l).float()
            rel = y.reshape(-1, y.shape[-1]).norm(dim=-1) / h.reshape(-1, h.shape[-1]).norm(
                dim=-1).clamp_min(1e-12)
            sums[l]["rel"].append(rel.cpu())
        return hook

    def routing(l):
        def hook(_mod, _args, r):
            g_TN, m_TN = r.gates_TN.detach().float(), r.mask_TN.detach()
            sums[l]["gate_sum"].append(g_TN.sum(-1).cpu())
            sums[l]["gate_active"].append(g_TN[m_TN.bool()].cpu())
            sums[l]["active"].append(m_TN.float().sum(-1).cpu())
        return hook

    for l, block in enumerate(layers):
        hooks.append(block.ffn_norm.register_forward_pre_hook(keep_h(l)))
        hooks.append(block.ffn.register_forward_hook(ffn_out(l)))
        router = getattr(block.ffn, "router", None)
        if isinstance(router, Router):
            hooks.append(router.register_forward_hook(routing(l)))
    seen = 0
    model.eval()
    try:
        with torch.no_grad():
            for ids, *_ in batches:
                if seq_len:
                    ids = ids[:, :seq_len]
                model(input_ids=ids.to(next(model.parameters()).device))
                seen += ids.numel()
                if max_tokens and seen >= max_tokens:
                    break
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for l, s in enumerate(sums):
        row: dict[str, Any] = {"layer": l, "tokens": seen,
                               "ffn_rel": float(torch.cat(s["rel"]).mean()) if s["rel"] else None}
        if s["gate_sum"]:
            gs = torch.cat(s["gate_sum"]).numpy()
            ga = torch.cat(s["gate_active"]).numpy()
            row.update(gate_sum=float(gs.mean()), gate_sum_p10=float(np.percentile(gs, 10)),
                       gate_sum_p90=float(np.percentile(gs, 90)),
                       gate_active=float(ga.mean()) if ga.size else None,
                       active=float(torch.cat(s["active"]).mean()))
        rows.append(row)
    return rows


def run_gate_stats(run: Run, opts: Options) -> list[dict[str, Any]]:
    from remoe.rundir.loading import load_model

    model_dir, toks = model_and_tokens(run, opts, strict=False)
    model, _ = load_model(model_dir)
    return gate_stats(model, toks.batches(), max_tokens=toks.limit or opts.max_tokens,
                      seq_len=toks.seq_len)


def analyze_gates(run: Run, out: Path, opts: Options, others: list[Run]) -> dict[str, Any]:
    """``gates.csv`` / ``gates.json`` (per run and layer) and ``gates.png``."""
    per_run = {run.name: run_gate_stats(run, opts)}
    for o in others:
        try:
            per_run[o.name] = run_gate_stats(o, Options(**{**opts.__dict__, "checkpoint": None}))
        except Skip:
            continue
    rows = [{"run": name, **r} for name, rs in per_run.items() for r in rs]
    files = [write_csv(out / "gates.csv", rows), write_json(out / "gates.json", per_run)]
    files.append(plots.save_png(_figure(per_run), out / "gates.png"))
    mine = per_run[run.name]
    return {"files": [f.name for f in files], "layers": mine,
            "gate_sum_mean": _mean(r.get("gate_sum") for r in mine),
            "ffn_rel_mean": _mean(r.get("ffn_rel") for r in mine)}


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def _figure(per_run: dict[str, list[dict[str, Any]]]):
    fig = plots.new_figure(9.0, 3.6)
    ax_g, ax_r = fig.subplots(1, 2)
    for i, (name, rows) in enumerate(per_run.items()):
        L = [r["layer"] for r in rows]
        if any(r.get("gate_sum") is not None for r in rows):
            g = [r.get("gate_sum", np.nan) for r in rows]
            lo = [r.get("gate_sum_p10", np.nan) for r in rows]
            hi = [r.get("gate_sum_p90", np.nan) for r in rows]
            ax_g.plot(L, g, "o-", color=f"C{i}", label=name)
            ax_g.fill_between(L, lo, hi, color=f"C{i}", alpha=0.15)
        ax_r.plot(L, [r.get("ffn_rel", np.nan) for r in rows], "o-", color=f"C{i}", label=name)
    ax_g.set_title("sum of gates per token (band: 10-90th pct.)", fontsize=9)
    ax_g.set_xlabel("layer")
    ax_r.set_title("FFN output / residual stream (mean of ||y||/||h||)", fontsize=9)
    ax_r.set_xlabel("layer")
    for ax in (ax_g, ax_r):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return fig
