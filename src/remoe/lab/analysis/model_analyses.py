"""The analyses of a run's model, all from one pass over evaluation tokens (:func:`routing_stats`,
cached in ``routing_stats.npz``): ``heatmap`` (Fig. 7b/c), ``specialization`` (Fig. 8, App. G)
and ``allocation`` (Fig. 6, App. H, Table 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from remoe.lab.analysis import plots
from remoe.lab.analysis.common import Options, Skip, json_safe, rel_files, write_csv, write_json
from remoe.lab.analysis.inactive import rule_text
from remoe.lab.analysis.routing import RoutingStats, collect_routing_stats, spearman
from remoe.lab.analysis.runlog import Run
from remoe.lab.analysis.tokens import TokenNames
from remoe.errors import ConfigError


def model_key(model_dir: Path) -> dict[str, Any]:
    w = model_dir / "model.safetensors"
    st = w.stat() if w.exists() else None
    return {"model_dir": str(model_dir.resolve()),
            "weights_mtime_ns": st.st_mtime_ns if st else None,
            "weights_bytes": st.st_size if st else None}


def routing_stats(run: Run, opts: Options, cache: Path | None) -> tuple[RoutingStats, TokenNames]:
    """The routing statistics of the run's model (one pass), reused from ``cache`` when it was
    made from the same weights, evaluation tokens, token budget and layers."""
    from remoe.lab.analysis.evaldata import eval_tokens
    from remoe.rundir.loading import load_model, resolve_model_dir

    try:
        model_dir = resolve_model_dir(opts.checkpoint or run.path)
    except ConfigError as e:
        if opts.checkpoint:
            raise
        raise Skip(f"no model in the run ({e})") from None
    toks = eval_tokens(run, opts.data, batch_size=opts.batch_size, max_tokens=opts.max_tokens,
                       cache_dir=opts.data_cache)
    key = json_safe({**model_key(model_dir), "data": toks.source, "max_tokens": opts.max_tokens,
                  "layers": opts.layers})
    if cache is not None and cache.is_file() and not opts.recompute:
        try:
            stats = RoutingStats.load(cache)
        except (OSError, ValueError, KeyError):
            stats = None
        if (stats is not None and stats.meta.get("key") == key
                and stats.no_expert_DL is not None):  # older caches lack it
            return stats, TokenNames(stats.meta.get("tokenizer"))
    model, tok = load_model(model_dir)
    if not model.config.is_moe:
        raise Skip(f"router={model.config.routing.router!r} has no routed experts")
    stats = collect_routing_stats(model, toks.batches(), toks.domains, max_tokens=toks.limit,
                                  layers=opts.layers, seq_len=toks.seq_len,
                                  meta={"key": key, "data_source": toks.source, "tokenizer": tok,
                                        "router": model.config.routing.router})
    if cache is not None:
        stats.save(cache)
    return stats, TokenNames(tok)


def layers_note(stats: RoutingStats, chosen: list[int] | None) -> str:
    """Which layers the per-layer figures show, said on the figure."""
    L = stats.num_layers
    shown = ", ".join(str(l) for l in stats.kept_layers)
    if len(stats.kept_layers) == L:
        return f"all {L} MoE layers shown"
    how = "chosen with --layers" if chosen is not None else "first, middle, last; --layers"
    return f"only layers {shown} of MoE layers 0-{L - 1} shown ({how})"


def _stats_title(run: Run, stats: RoutingStats) -> str:
    router = stats.meta.get("router", run.router)
    return f"{run.name} (router={router}, {stats.num_tokens:,} tokens)"


def analyze_heatmap(run: Run, stats: RoutingStats, out: Path, rule: str = "fair"
                    ) -> dict[str, Any]:
    ratio = stats.routed_ratio_LN()
    threshold = stats.inactive_threshold(rule)
    inactive = stats.inactive_LN(rule)
    rows = [{"layer": l, "expert": e, "routed_ratio": ratio[l, e], "inactive": bool(inactive[l, e])}
            for l in range(stats.num_layers) for e in range(stats.num_routed)]
    files = [write_csv(out / "routed_ratio.csv", rows)]
    act = stats.active_experts_L()
    rec = {"num_tokens": stats.num_tokens, "inactive_rule": rule,
           "inactive_rule_text": rule_text(rule), "inactive_threshold": threshold,
           "num_inactive": int(inactive.sum()), "inactive_per_layer": inactive.sum(1),
           "active_experts_per_layer": act,
           "effective_experts_per_layer": stats.effective_experts_L(),
           "never_firing_per_layer": stats.never_firing_L(),
           "no_expert_share_per_layer": stats.no_expert_share_L(),
           "mean_active_experts": float(act.mean()), "target_active": stats.target_active,
           "max_ratio": float(ratio.max()), "min_ratio": float(ratio.min()),
           # load imbalance per layer: max / mean routed ratio (1 = perfectly balanced)
           "imbalance_per_layer": (ratio.max(1) / np.maximum(ratio.mean(1), 1e-12))}
    files.append(write_json(out / "routed_ratio.json", rec))
    fig = plots.fig_routed_heatmap(ratio, inactive, threshold,
                                   f"average routed tokens ratio\n{_stats_title(run, stats)}")
    files.append(plots.save_png(fig, out / "routed_ratio.png"))
    return {**rec, "files": rel_files(files, out)}


def analyze_specialization(run: Run, stats: RoutingStats, out: Path,
                           layers: list[int] | None = None) -> dict[str, Any]:
    spec = stats.specialization()
    if spec["num_domains"] < 2:
        raise Skip(f"needs tokens of at least 2 domains, got {stats.domains} (use --data "
                   "validation or an .npz with domain_ids)")
    keep = stats.present_domains()
    names = [stats.domains[d] for d in keep]
    r = stats.domain_ratio_DLN()
    rows = [{"domain": stats.domains[d], "domain_tokens": int(stats.tokens_D[d]), "layer": l,
             "expert": e, "routed_ratio": r[d, l, e]}
            for d in keep for l in range(stats.num_layers) for e in range(stats.num_routed)]
    files = [write_csv(out / "specialization.csv", rows)]
    rec = {**spec, "domains": names,
           "domain_tokens": {stats.domains[d]: int(stats.tokens_D[d]) for d in keep},
           "layers_plotted": stats.kept_layers, "uniform_ratio": stats.uniform_ratio}
    files.append(write_json(out / "specialization.json", rec))
    title = (f"routed tokens ratio per domain: {_stats_title(run, stats)}\nspecialisation index "
             f"{spec['index']:.3f}, domain–expert MI {spec['mi_bits']:.3f} bits\n"
             f"{layers_note(stats, layers)}")
    fig = plots.fig_specialization(r[keep], names, stats.kept_layers, stats.uniform_ratio, title)
    files.append(plots.save_png(fig, out / "specialization.png"))
    return {**rec, "files": rel_files(files, out)}


def analyze_allocation(run: Run, stats: RoutingStats, names: TokenNames, out: Path,
                       opts: Options) -> dict[str, Any]:
    files: list[Path] = []
    table = stats.token_table(min_count=opts.min_count)
    if table["token_id"].size == 0:
        table = stats.token_table(min_count=1)
    rho = spearman(table["frequency"], table["mean_active"])
    rows = [{"rank": i, "token_id": int(t), "token": names.text(int(t)), "count": int(c),
             "frequency": f, "mean_active": a,
             **{f"active_layer{l}": v for l, v in enumerate(la)}}
            for i, (t, c, f, a, la) in enumerate(zip(table["token_id"], table["count"],
                                                     table["frequency"], table["mean_active"],
                                                     table["layer_active"]))]
    files.append(write_csv(out / "token_allocation.csv", rows))
    fig = plots.fig_token_allocation(table, names, rho, stats.target_active,
                                     f"{run.name}: active experts vs token frequency")
    files.append(plots.save_png(fig, out / "allocation_tokens.png"))

    act = stats.domain_active_DL()
    keep = stats.present_domains()
    files.append(write_csv(out / "domain_allocation.csv", [
        {"domain": stats.domains[d], "domain_tokens": int(stats.tokens_D[d]), "layer": l,
         "mean_active_experts": act[d, l]} for d in keep for l in range(stats.num_layers)]))
    fig = plots.fig_domain_allocation(act[keep], stats.active_experts_L(),
                                      [stats.domains[d] for d in keep], stats.target_active,
                                      f"domain-level expert allocation\n"
                                      f"{_stats_title(run, stats)}")
    files.append(plots.save_png(fig, out / "allocation_domains.png"))

    top_rows, top_json = [], {}
    for l in stats.kept_layers:
        per_expert = stats.top_tokens(l, top=opts.top_tokens, min_count=opts.min_count)
        top_json[str(l)] = [[{**it, "token": names.text(it["token_id"])} for it in items]
                            for items in per_expert]
        for e, items in enumerate(per_expert):
            for rank, it in enumerate(items):
                top_rows.append({"layer": l, "expert": e, "rank": rank, "token_id": it["token_id"],
                                 "token": names.text(it["token_id"]), "count": it["count"],
                                 "routed": it["routed"], "prob": it["prob"],
                                 "share": it["share"], "base": it["base"], "lift": it["lift"]})
        fig = plots.fig_top_tokens(per_expert, l, names,
                                   f"{run.name}: tokens over-represented in each expert of layer "
                                   f"{l} (ranked by share − base frequency; occurrences >= "
                                   f"{opts.min_count})", top=opts.top_tokens,
                                   expert_ratio=stats.expert_ratio(l),
                                   note=layers_note(stats, opts.layers))
        files.append(plots.save_png(fig, out / f"top_tokens_layer{l}.png"))
    files.append(write_csv(out / "top_tokens.csv", top_rows))
    rec = {"num_tokens_listed": int(table["token_id"].size), "min_count": opts.min_count,
           "layers_plotted": stats.kept_layers, "num_layers": stats.num_layers,
           "top_tokens_statistic": "share - base (lift = share / base > 1)",
           "spearman_freq_active": rho,
           "domain_active_experts": {stats.domains[d]: act[d] for d in keep},
           "domain_spread_per_layer": (np.nanmax(act[keep], 0) - np.nanmin(act[keep], 0)),
           "top_tokens": top_json, "tokenizer": names.available}
    files.append(write_json(out / "allocation.json", rec))
    return {**{k: v for k, v in rec.items() if k != "top_tokens"}, "files": rel_files(files, out)}
