"""The analyses of a run's model, all from one pass over evaluation tokens (:func:`routing_stats`,
cached in ``routing_stats.npz``): ``heatmap`` (Fig. 7b/c), ``specialization`` (Fig. 8, App. G)
and ``allocation`` (Fig. 6, App. H, Table 10); their token strings (:class:`TokenNames`, from the
run's ``tokenizer.json``).

Where the model-based analyses (these and ``gates``) get their tokens from (``--data``,
:func:`eval_tokens`):

* ``validation`` -- the run's validation split with domain labels, read from the prepared data
  cache named in the run's ``config.yaml`` (``data.cache_dir``, or ``--data-cache``) with
  :func:`remoe.data.load_prepared` (never rebuilt here). Every domain gets the same number of
  chunks: ceil(max_tokens / (domains x seq_len)) evenly spaced chunks per domain.
* ``calib`` -- the run's fixed calibration tokens (``token_ids`` of its routing mask files),
  one pseudo-domain ``calibration``.
* a path to an ``.npz`` file with ``input_ids`` int [B, S] and optionally ``domain_ids`` int [B]
  and ``domains`` (names): any tokens you want to analyse.
* ``auto`` (default) -- ``validation`` if the data cache opens, else ``calib`` (with a warning).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable

import numpy as np
import torch

from remoe.lab.analysis import plots, plots_routing
from remoe.lab.analysis.common import (Options, Skip, json_safe, rel_files, rule_text, write_csv,
                                       write_json)
from remoe.lab.analysis.routing import RoutingStats, collect_routing_stats, spearman
from remoe.lab.analysis.runlog import Run, load_masks
from remoe.errors import ConfigError


@dataclass
class EvalTokens:
    batches: Callable[[], Iterable]  # -> iterator of (input_ids [B, S'], domain_ids [B])
    domains: list[str]
    seq_len: int | None  # columns to feed (None: all)
    source: str  # a description for the outputs
    limit: int | None = None  # stop after this many tokens (None: the batches are bounded)


def _rows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    n = ids.size // seq_len
    return ids[: n * seq_len].reshape(n, seq_len) if n else ids.reshape(1, -1)


def _batched(input_ids: np.ndarray, domain_ids: np.ndarray, batch_size: int):
    for i in range(0, input_ids.shape[0], batch_size):
        yield (torch.from_numpy(np.ascontiguousarray(input_ids[i:i + batch_size], dtype=np.int64)),
               torch.from_numpy(np.ascontiguousarray(domain_ids[i:i + batch_size], dtype=np.int64)))


def calib_tokens(run: Run, batch_size: int, max_tokens: int | None) -> EvalTokens:
    files = run.mask_files()
    if not files:
        raise ConfigError(f"--data calib: {run.path}/routing holds no masks_<step>.npz")
    _, token_ids, _ = load_masks(files[-1][1])
    ids = _rows(token_ids.astype(np.int64), min(run.seq_len(), token_ids.size))
    return EvalTokens(lambda: _batched(ids, np.zeros(ids.shape[0], np.int64), batch_size),
                      ["calibration"], None, f"calibration set of {files[-1][1].name}",
                      max_tokens)


def npz_tokens(path: Path, batch_size: int, max_tokens: int | None) -> EvalTokens:
    with np.load(path, allow_pickle=False) as z:
        if "input_ids" not in z.files:
            raise ConfigError(f"--data {str(path)!r} has no 'input_ids' array")
        ids = np.asarray(z["input_ids"], dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        dom = (np.asarray(z["domain_ids"], dtype=np.int64).reshape(-1) if "domain_ids" in z.files
               else np.zeros(ids.shape[0], np.int64))
        names = ([str(x) for x in z["domains"]] if "domains" in z.files
                 else [f"domain{i}" for i in range(int(dom.max()) + 1 if dom.size else 1)])
    if dom.shape[0] != ids.shape[0]:
        raise ConfigError(f"--data {str(path)!r}: domain_ids has {dom.shape[0]} rows, input_ids "
                          f"{ids.shape[0]}")
    return EvalTokens(lambda: _batched(ids, dom, batch_size), names, None, f"tokens of {path}",
                      max_tokens)


def validation_tokens(run: Run, batch_size: int, max_tokens: int | None,
                      cache_dir: str | None) -> EvalTokens:
    from remoe.data import load_prepared

    cache = cache_dir or (run.config.get("data") or {}).get("cache_dir")
    if not cache:
        raise ConfigError(f"{run.path}/config.yaml names no data.cache_dir (use --data-cache)")
    try:
        bundle = load_prepared(cache, verify=False)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(f"--data validation: {e}") from None
    seq = run.seq_len()
    per_domain = (None if max_tokens is None
                  else max(1, math.ceil(max_tokens / (len(bundle.domains) * seq))))
    return EvalTokens(
        lambda: ((b.input_ids, b.domain_ids) for b in bundle.eval_batches(
            "validation", seq_len=seq, batch_size=batch_size, max_chunks_per_domain=per_domain)),
        list(bundle.domains), seq,
        f"validation split of {cache}, {per_domain or 'all'} chunks of {seq} tokens per domain")


def eval_tokens(run: Run, data: str = "auto", *, batch_size: int = 8,
                max_tokens: int | None = None, cache_dir: str | None = None) -> EvalTokens:
    """The :class:`EvalTokens` named by ``data`` (see the module docstring)."""
    if data == "calib":
        return calib_tokens(run, batch_size, max_tokens)
    if data == "validation":
        return validation_tokens(run, batch_size, max_tokens, cache_dir)
    if data == "auto":
        try:
            return validation_tokens(run, batch_size, max_tokens, cache_dir)
        except (ConfigError, ImportError) as e:
            print(f"remoe analyze: warning: no validation data ({e}); using the calibration "
                  "tokens of the routing masks (no domain labels)", file=sys.stderr)
            return calib_tokens(run, batch_size, max_tokens)
    p = Path(data)
    if p.suffix == ".npz" and p.is_file():
        return npz_tokens(p, batch_size, max_tokens)
    raise ConfigError(f"--data={data!r} must be auto, validation, calib or an existing .npz file")


def model_and_tokens(run: Run, opts: Options, strict: bool = True) -> tuple[Path, EvalTokens]:
    """The model directory (``opts.checkpoint``, else the run's; Skip without one, the
    ConfigError where a ``strict`` analysis names a checkpoint) and the evaluation tokens."""
    from remoe.rundir.loading import resolve_model_dir

    try:
        model_dir = resolve_model_dir(opts.checkpoint or run.path)
    except ConfigError as e:
        if strict and opts.checkpoint:
            raise
        raise Skip(f"no model in the run ({e})") from None
    return model_dir, eval_tokens(run, opts.data, batch_size=opts.batch_size,
                                  max_tokens=opts.max_tokens, cache_dir=opts.data_cache)


class TokenNames:
    """``names(id)`` -> a quoted, escaped token string such as ``' the'`` or ``'\\n'``.

    Without a tokenizer every token is shown as ``#<id>``. A byte-level piece that is not
    valid UTF-8 on its own (part of a multi-byte character) is shown as its bytes.
    """

    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self.tok = None
        if tokenizer_path is not None and Path(tokenizer_path).is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(tokenizer_path))

    @property
    def available(self) -> bool:
        return self.tok is not None

    def _piece(self, token_id: int) -> str | bytes:
        """Decoded text, or the raw bytes of a byte-level piece that is not valid UTF-8."""
        s = self.tok.decode([int(token_id)], skip_special_tokens=False)
        if s and "\ufffd" not in s:
            return s
        raw = self.tok.id_to_token(int(token_id)) or f"#{token_id}"
        if all(c in BYTE_OF_CHAR for c in raw):
            return bytes(BYTE_OF_CHAR[c] for c in raw)
        return raw

    def text(self, token_id: int) -> str:
        """The decoded text of one token (unquoted; byte pieces as ``<0xE2 0x80>``)."""
        if self.tok is None:
            return f"#{token_id}"
        p = self._piece(token_id)
        return p if isinstance(p, str) else "<" + " ".join(f"0x{b:02X}" for b in p) + ">"

    def __call__(self, token_id: int) -> str:
        """Quoted and escaped (``' the'``, ``'\\n'``); byte pieces as ``b'\\xe2\\x80'``."""
        if self.tok is None:
            return f"#{token_id}"
        return repr(self._piece(token_id))


def _byte_level_alphabet() -> MappingProxyType:
    """Inverse of the byte-level BPE alphabet: printable Latin-1 bytes stand for themselves,
    every other byte b is the character 256 + (its rank among those bytes)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {chr(b): b for b in keep}
    others = [b for b in range(256) if b not in set(keep)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return MappingProxyType(table)


BYTE_OF_CHAR = _byte_level_alphabet()


def model_key(model_dir: Path) -> dict[str, Any]:
    w = model_dir / "model.safetensors"
    st = w.stat() if w.exists() else None
    return {"model_dir": str(model_dir.resolve()),
            "weights_mtime_ns": st.st_mtime_ns if st else None,
            "weights_bytes": st.st_size if st else None}


def routing_stats(run: Run, opts: Options, cache: Path | None) -> tuple[RoutingStats, TokenNames]:
    """The routing statistics of the run's model (one pass), reused from ``cache`` when it was
    made from the same weights, evaluation tokens, token budget and layers."""
    from remoe.rundir.loading import load_model

    model_dir, toks = model_and_tokens(run, opts)
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
    fig = plots_routing.fig_routed_heatmap(ratio, inactive, threshold,
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
    fig = plots_routing.fig_specialization(r[keep], names, stats.kept_layers,
                                           stats.uniform_ratio, title)
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
    fig = plots_routing.fig_token_allocation(table, names, rho, stats.target_active,
                                     f"{run.name}: active experts vs token frequency")
    files.append(plots.save_png(fig, out / "allocation_tokens.png"))

    act = stats.domain_active_DL()
    keep = stats.present_domains()
    files.append(write_csv(out / "domain_allocation.csv", [
        {"domain": stats.domains[d], "domain_tokens": int(stats.tokens_D[d]), "layer": l,
         "mean_active_experts": act[d, l]} for d in keep for l in range(stats.num_layers)]))
    fig = plots_routing.fig_domain_allocation(act[keep], stats.active_experts_L(),
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
        fig = plots_routing.fig_top_tokens(per_expert, l, names,
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
