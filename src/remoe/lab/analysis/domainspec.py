"""``remoe analyze domains RUN [RUN ...]``: domain specialisation from the recorded routing
masks, with a shuffled-label null (paper §5.2 Fig. 8 and App. G; docs/ANALYSIS.md).

Needs no weights, only a run's committed files and its data cache. Two sources per run:

* ``calib``: its ``routing/masks_<step>.npz`` (or ``routing.zip``) hold the masks of its
  calibration sequences (``token_ids``) but not their domains; exact counts, but few tokens
  (``calib_tokens``). The trainer takes them from the validation split
  (:func:`remoe.train.metrics.calibration_set`), so each calibration row of ``seq_len`` tokens
  is found, by its content, among the labelled validation chunks of the run's data cache
  (:func:`row_domains_R`). A row found in no chunk (another cache, another tokenizer) or in
  chunks of two domains is an error: the labels are exact or absent. The null permutes the
  sequences' domains; the layer-mean test is repeated at every recorded step of the same tokens.
* ``train``: the last ``train_steps`` steps' ``expert_counts`` of ``metrics.jsonl`` regressed
  on the domains of their batches (:func:`remoe.lab.analysis.domainstats.regression_test`);
  millions of tokens, an estimate. The null permutes the steps' domain mixes; ``alignment``
  gives the layer-mean MI with the batches shifted by one step, where no signal should remain.

Then the routed-tokens ratio per domain, layer and expert, and the specialisation statistics
of :mod:`remoe.lab.analysis.domainstats` against ``shuffles`` permutations.

Legend: R calibration sequences, D domains, L MoE layers, N experts, P shuffles.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from remoe.errors import ConfigError
from remoe.lab.analysis import plots
from remoe.lab.analysis.common import rel_files, write_csv, write_json
from remoe.lab.analysis.domainstats import (NullTest, domain_ratio_xDLN, mi_bits_xL,
                                            regressed_ratio_xDLN, regression_test, shuffle_test,
                                            shuffled_labels_PR, step_compositions_SD,
                                            step_counts, unit_counts)
from remoe.lab.analysis.plots_routing import fig_specialisation, fig_specialization
from remoe.lab.analysis.runlog import Run, load_masks

_AMBIGUOUS = -1


def validation_index(bundle, seq_len: int, batch_size: int = 256) -> dict[bytes, int]:
    """First ``seq_len`` tokens (int64 bytes) of every validation chunk -> its domain id."""
    index: dict[bytes, int] = {}
    for batch in bundle.eval_batches("validation", seq_len=seq_len, batch_size=batch_size):
        ids = batch.input_ids[:, :seq_len].numpy().astype(np.int64)
        for row, dom in zip(ids, batch.domain_ids.numpy()):
            key = row.tobytes()
            prev = index.get(key)
            index[key] = int(dom) if prev in (None, int(dom)) else _AMBIGUOUS
    return index


def row_domains_R(token_ids_T: np.ndarray, seq_len: int, index: dict[bytes, int],
                  where: str = "calibration set") -> np.ndarray:
    """Domain id of each ``seq_len``-token row of ``token_ids_T`` (ConfigError if unknown)."""
    T = int(token_ids_T.size)
    if seq_len < 1 or T % seq_len:
        raise ConfigError(f"{where}: {T} tokens are not whole rows of seq_len={seq_len}")
    rows = np.asarray(token_ids_T, dtype=np.int64).reshape(T // seq_len, seq_len)
    out = np.empty(rows.shape[0], dtype=np.int64)
    for r, row in enumerate(rows):
        dom = index.get(row.tobytes())
        if dom is None:
            raise ConfigError(f"{where}: row {r} is not a validation chunk of the data cache "
                              "(a different cache or tokenizer; rebuild it with `remoe data` "
                              "and the run's data config)")
        if dom == _AMBIGUOUS:
            raise ConfigError(f"{where}: row {r} occurs in validation chunks of two domains")
        out[r] = dom
    return out


@dataclass
class DomainRouting:
    """One run's per-domain routing from one source, with its null tests.

    ``calib``: the calibration masks of one recorded step, the unit a sequence; ``train``: the
    regression of the last training steps' counts on their batches' domains, the unit a step.
    """

    label: str
    source: str  # calib | train
    router: str
    seed: int | None
    step: int  # the recorded step (calib) or the last step of the window (train)
    top_k: int
    num_experts: int
    domains: list[str]  # the D present domains
    ratio_DLN: np.ndarray  # r_{d,l,e}
    tokens_D: np.ndarray  # tokens per domain behind it
    units_D: np.ndarray  # sequences per domain (calib); sequences per domain in the window
    num_units: int  # sequences (calib) or steps (train) permuted by the null
    tests: dict[str, NullTest]
    p_floor: float  # the smallest p the permutation test can give
    steps: list[dict]  # calib: the layer-mean MI test at every recorded step
    alignment: dict[int, float] | None = None  # train: layer-mean MI with batches shifted


def partitions_p_floor(sizes: list[int]) -> float:
    """1 / the number of distinct partitions of sum(sizes) units into groups of ``sizes``
    (domains of equal size interchangeable: the statistics weight domains equally)."""
    parts = math.factorial(sum(sizes))
    for n in sizes:
        parts //= math.factorial(n)
    for m in Counter(sizes).values():
        parts //= math.factorial(m)
    return 1.0 / parts


def _mask_file(run: Run, step: int | None):
    files = run.mask_files()
    if not files:
        raise ConfigError(f"{run.path}: no routing masks (routing/masks_<step>.npz or routing.zip)")
    if step is None:
        return files[-1][1], files
    for s, f in files:
        if s == step:
            return f, files
    raise ConfigError(f"{run.path}: no masks of step {step} (recorded: "
                      f"{files[0][0]}..{files[-1][0]})")


def _model_fields(run: Run, num_experts: int) -> dict:
    cfg = run.config.get("model") or {}
    router = cfg.get("router") or run.summary.get("router") or "?"  # as written, no model import
    return {"router": str(router), "seed": (run.config.get("run") or {}).get("seed"),
            "top_k": int(cfg.get("top_k") or 1),
            "num_experts": int(cfg.get("num_experts") or num_experts)}


def calib_routing(run: Run, label: str, index: dict[bytes, int], domain_names: list[str], *,
                  step: int | None = None, shuffles: int = 1000, seed: int = 0
                  ) -> DomainRouting:
    """The per-domain routing of ``run``'s calibration masks and its null tests."""
    mfile, files = _mask_file(run, step)
    masks_LTN, token_ids_T, at = load_masks(mfile)
    seq_len = min(run.seq_len(), token_ids_T.size)
    global_R = row_domains_R(token_ids_T, seq_len, index, f"{run.path} masks of step {at}")
    present = np.unique(global_R)
    if present.size < 2:
        raise ConfigError(f"{run.path}: the calibration sequences cover one domain "
                          f"({domain_names[present[0]]}); no specialisation to measure")
    labels_R = np.searchsorted(present, global_R)
    counts_RLN, tokens_R = unit_counts(masks_LTN, seq_len)
    labels_PR = shuffled_labels_PR(labels_R, shuffles, seed)
    tests = shuffle_test(counts_RLN, tokens_R, labels_R, labels_PR=labels_PR)
    steps = []
    for s, f in files:  # the same tokens at every recorded step (others are skipped)
        m_LTN, ids_T, _ = load_masks(f)
        if not np.array_equal(ids_T, token_ids_T):
            continue
        c_RLN, _ = unit_counts(m_LTN, seq_len)
        mi = shuffle_test(c_RLN, tokens_R, labels_R, labels_PR=labels_PR, statistics=("mi",))
        steps.append({"step": s, **mi["mi"].layer_mean()})
    D = present.size
    units_D = np.bincount(labels_R, minlength=D)
    return DomainRouting(
        label=label, source="calib", step=at, **_model_fields(run, masks_LTN.shape[2]),
        domains=[domain_names[d] for d in present],
        ratio_DLN=domain_ratio_xDLN(counts_RLN, tokens_R, labels_R, D),
        tokens_D=np.bincount(labels_R, weights=tokens_R, minlength=D).astype(np.int64),
        units_D=units_D, num_units=int(labels_R.size), tests=tests,
        p_floor=partitions_p_floor([int(n) for n in units_D]), steps=steps)


def train_routing(run: Run, label: str, bundle, *, last_steps: int = 600, shuffles: int = 1000,
                  seed: int = 0) -> DomainRouting:
    """The per-domain routing regressed from the last ``last_steps`` logged steps."""
    tc = run.config.get("train") or {}
    seq_len = run.seq_len()
    sampler = bundle.train_batches(seq_len=seq_len, micro_batch=int(tc.get("micro_batch_size")),
                                   grad_accum=int(tc.get("grad_accum") or 1),
                                   seed=int((run.config.get("run") or {}).get("seed") or 0),
                                   require_validation=False)
    steps_S, counts_SLN = step_counts(run.metrics.records, last_steps)
    D = len(bundle.domains)
    n_SD = step_compositions_SD(sampler, steps_S, D)
    r_DLN, tests = regression_test(n_SD, counts_SLN, seq_len + 1, shuffles, seed)
    alignment = {off: float(np.nanmean(mi_bits_xL(regressed_ratio_xDLN(
        step_compositions_SD(sampler, steps_S, D, off), counts_SLN, seq_len + 1))))
        for off in (-1, 1)}
    units_D = n_SD.sum(0).astype(np.int64)
    return DomainRouting(
        label=label, source="train", step=int(steps_S[-1]),
        **_model_fields(run, counts_SLN.shape[2]), domains=list(bundle.domains),
        ratio_DLN=r_DLN, tokens_D=units_D * (seq_len + 1), units_D=units_D,
        num_units=int(steps_S.size), tests=tests, p_floor=1.0 / (shuffles + 1), steps=[],
        alignment=alignment)


def analyze_domains(runs: list[Run], *, data_cache: str | None = None, step: int | None = None,
                    shuffles: int = 1000, seed: int = 0, train_steps: int = 600,
                    log=print) -> list[DomainRouting]:
    """Both sources for every run (one data cache, never rebuilt here, and validation index per
    cache, seq_len)."""
    from remoe.data import load_prepared

    bundles: dict[str, Any] = {}
    indexes: dict[tuple[str, int], dict[bytes, int]] = {}
    seen: Counter = Counter()
    out = []
    for run in runs:
        cache = data_cache or (run.config.get("data") or {}).get("cache_dir")
        if not cache:
            raise ConfigError(f"{run.path}/config.yaml names no data.cache_dir (use --data-cache)")
        if cache not in bundles:
            try:
                bundles[cache] = load_prepared(cache, verify=False)
            except (FileNotFoundError, ValueError, OSError) as e:
                raise ConfigError(f"data cache {str(cache)!r}: {e}") from None
        bundle = bundles[cache]
        key = (str(cache), run.seq_len())
        if key not in indexes:
            indexes[key] = validation_index(bundle, run.seq_len())
        seen[run.name] += 1
        label = run.name if seen[run.name] == 1 else f"{run.name}#{seen[run.name]}"
        log(f"  {label}: masks and training log of {run.path}, domains from {cache}")
        out.append(calib_routing(run, label, indexes[key], list(bundle.domains), step=step,
                                 shuffles=shuffles, seed=seed))
        if train_steps > 0:
            out.append(train_routing(run, label, bundle, last_steps=train_steps,
                                     shuffles=shuffles, seed=seed))
    return out


# ----------------------------------------------------------------------------- outputs

def _head(dr: DomainRouting) -> dict[str, Any]:
    return {"run": dr.label, "source": dr.source, "router": dr.router, "seed": dr.seed,
            "step": dr.step}


def run_record(dr: DomainRouting) -> dict[str, Any]:
    mean = dr.tests["mi"].layer_mean()
    return {**_head(dr), "num_experts": dr.num_experts, "top_k": dr.top_k, "domains": dr.domains,
            "domain_tokens": dict(zip(dr.domains, dr.tokens_D.tolist())),
            "domain_sequences": dict(zip(dr.domains, dr.units_D.tolist())),
            "units": dr.num_units, "unit": "sequence" if dr.source == "calib" else "step",
            "p_floor": dr.p_floor,
            "separable_from_null": bool(mean["p"] < 0.05),
            "tests": {s: {"layers": t.per_layer(), "mean": t.layer_mean()}
                      for s, t in dr.tests.items()},
            "steps": dr.steps, "alignment_mi_shifted": dr.alignment}


def routing_rows(dr: DomainRouting) -> list[dict[str, Any]]:
    r_DLN = dr.ratio_DLN
    share_DLN = r_DLN / np.where(r_DLN.sum(-1, keepdims=True) > 0, r_DLN.sum(-1, keepdims=True),
                                 np.nan)
    tok, seqs = dr.tokens_D, dr.units_D
    D, L, N = r_DLN.shape
    return [{**_head(dr), "domain": dr.domains[d], "domain_sequences": int(seqs[d]),
             "domain_tokens": int(tok[d]), "layer": l, "expert": e, "routed_ratio": r_DLN[d, l, e],
             "pair_share": share_DLN[d, l, e]}
            for d in range(D) for l in range(L) for e in range(N)]


def test_rows(dr: DomainRouting) -> list[dict[str, Any]]:
    return [{**_head(dr), "statistic": s, **row}
            for s, t in dr.tests.items() for row in (*t.per_layer(), t.layer_mean())]


def step_rows(dr: DomainRouting) -> list[dict[str, Any]]:
    return [{**_head(dr), "statistic": "mi", "layer": "mean",
             **{k: v for k, v in row.items() if k != "layer"}} for row in dr.steps]


def run_domains(args, paths: list[str]) -> int:
    """``remoe analyze domains``: writes, into ``--out`` (default the first run's ``analysis/``):
    ``domain_routing.csv``, ``specialisation.csv``, ``specialisation_steps.csv``,
    ``specialisation.json``, ``specialisation_<source>.png`` and
    ``domain_routing_<run>_<source>.png`` (sources ``calib`` and ``train``)."""
    if not paths:
        raise ConfigError("remoe analyze domains: no run directory given")
    if args.train_steps < 0:
        raise ConfigError(f"--train-steps={args.train_steps} must be >= 0")
    if args.shuffles < 2:
        raise ConfigError(f"--shuffles={args.shuffles} must be >= 2")
    runs = []
    for p in paths:
        if not Path(p).is_dir():
            raise ConfigError(f"run directory {p!r} does not exist")
        runs.append(Run(p))
    out = Path(args.out) if args.out else runs[0].path / "analysis"
    print(f"remoe analyze domains -> {out}")
    found = analyze_domains(runs, data_cache=args.data_cache, step=args.mask_step,
                            shuffles=args.shuffles, seed=args.shuffle_seed,
                            train_steps=args.train_steps)
    records = [run_record(dr) for dr in found]
    files = [write_csv(out / "domain_routing.csv", [r for dr in found for r in routing_rows(dr)]),
             write_csv(out / "specialisation.csv", [r for dr in found for r in test_rows(dr)]),
             write_csv(out / "specialisation_steps.csv",
                       [r for dr in found for r in step_rows(dr)])]
    for dr in found:
        L = dr.ratio_DLN.shape[1]
        layers = args.layers if args.layers else list(range(L))
        if any(not 0 <= l < L for l in layers):
            raise ConfigError(f"--layers={layers}: {dr.label} has MoE layers 0..{L - 1}")
        mi = dr.tests["mi"].layer_mean()
        toks = ", ".join(f"{d} {int(t)}" for d, t in zip(dr.domains, dr.tokens_D))
        what = (f"calibration masks of step {dr.step}" if dr.source == "calib" else
                f"regressed from the {dr.num_units} training steps to {dr.step}")
        title = (f"{dr.label} ({dr.router}): routed tokens ratio per domain, {what}\n"
                 f"domain-expert MI {mi['observed']:.3f} bits (null {mi['null_mean']:.3f}, "
                 f"z {mi['z']:.1f}, p {mi['p']:.3g})\ntokens: {toks}")
        fig = fig_specialization(dr.ratio_DLN, dr.domains, layers, dr.top_k / dr.num_experts,
                                 title)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dr.label)
        files.append(plots.save_png(fig, out / f"domain_routing_{safe}_{dr.source}.png"))
    for source, what in (("calib", "the calibration masks (unit: a sequence)"),
                         ("train", "the training log regressed on batch domains (unit: a step)")):
        recs = [r for r in records if r["source"] == source]
        if recs:
            files.append(plots.save_png(fig_specialisation(
                recs, f"domain specialisation from {what},\n{args.shuffles} shuffles"),
                out / f"specialisation_{source}.png"))
    summary = {"shuffles": args.shuffles, "shuffle_seed": args.shuffle_seed,
               "train_steps": args.train_steps, "mask_step": args.mask_step, "runs": records}
    files.append(write_json(out / "specialisation.json", summary))
    for rec in records:
        m = rec["tests"]["mi"]["mean"]
        per = ", ".join(f"{r['observed']:.3f} (z {r['z']:.1f})"
                        for r in rec["tests"]["mi"]["layers"])
        print(f"  {rec['run']:<14} {rec['source']:<5} step {rec['step']}: MI per layer {per}; "
              f"layer mean {m['observed']:.3f} bits, null {m['null_mean']:.3f} ± "
              f"{m['null_std']:.3f}, z {m['z']:.2f}, p {m['p']:.3g} (floor {rec['p_floor']:.2g})")
    print("  " + ", ".join(rel_files(files, out)))
    return 0
