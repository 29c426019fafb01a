"""What the GPU study returns, rewritten whole after every evaluation, and its table and figure,
rebuilt from those JSON files alone (``--results-only``).

A lent GPU machine returns at most 8 files of at most 16 MiB, at most two folders down, and a
command cut off at its time limit returns whatever is on disk then. So ``$OUT`` holds:

```
gpu_study.json          the study so far: device, data, plan, every run's numbers (small)
gpu_study.log           one line per event
gpu_study.md / .png     the table and the figure (:func:`write`), after each run
runs/<name>.json.gz     one per run: its learning curve, per-layer sparsity and effective
                        experts per evaluation interval, FLOPs, and the run's small files
                        (metrics.jsonl lines, eval.jsonl lines, summary.json); never weights
```

Every file is written to a temporary name and renamed over the old one, so a cut-off run leaves
the last complete version. Effective experts of a layer: ``exp(H(p))`` with ``p`` the layer's
per-expert token counts (``expert_counts`` of the metrics lines, summed over the interval)
normalised to 1: E when every expert gets the same share, 1 when one expert gets every token.

``gpu_study.md``: our runs, the paper's 182M numbers beside them with the difference in scale,
the learning curves and their crossovers at matched tokens and FLOPs
(:mod:`remoe.lab.study.curves`). ``gpu_study.png``: validation loss against tokens and against
training FLOPs, as the paper's training-curve figures, and the sparsity of every step, as its
Figure 3. Matched tokens / FLOPs: each run's fixed-sample validation curve linearly
interpolated at the smallest final tokens / FLOPs over the runs (every run trains the same
tokens unless one was cut; TopK spends the fewest FLOPs).
"""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from remoe.fileio import atomic_open, atomic_write_bytes, atomic_write_text
from remoe.lab.analysis.report_html import is_number, num
from remoe.lab.study.curves import Curve, markdown_section
from remoe.rundir.files import finite_or_none

SUMMARY, LOG, RUNS_DIR = "gpu_study.json", "gpu_study.log", "runs"


def effective_experts(counts_LE: list[list[float]]) -> list[float | None]:
    """``exp`` of the entropy of each layer's token shares (None for a layer with no token)."""
    import torch

    from remoe.model.losses import effective_experts_of

    if not counts_LE:
        return []
    eff_L = effective_experts_of(torch.tensor(counts_LE, dtype=torch.float64)).tolist()
    return [e if sum(row) > 0 else None for e, row in zip(eff_L, counts_LE)]


def layer_stats(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per MoE layer over ``records`` (metrics lines): mean sparsity, summed expert counts,
    effective experts of those counts. None without routed layers."""
    recs = [r for r in records if r.get("expert_counts")]
    if not recs:
        return None
    L, E = len(recs[0]["expert_counts"]), len(recs[0]["expert_counts"][0])
    counts = [[sum(r["expert_counts"][layer][e] for r in recs) for e in range(E)]
              for layer in range(L)]
    sparsity = [sum(r["layer_sparsity"][layer] for r in recs) / len(recs) for layer in range(L)] \
        if all(r.get("layer_sparsity") for r in recs) else None
    return {"first_step": recs[0]["step"], "last_step": recs[-1]["step"], "steps": len(recs),
            "layer_sparsity": sparsity, "expert_counts": counts,
            "effective_experts": effective_experts(counts)}


def last_share(records: list[dict[str, Any]], share: float = 0.1) -> list[dict[str, Any]]:
    """The last ``share`` of the records (at least one): the end of the run, for its final
    per-layer figures."""
    n = max(1, int(math.ceil(len(records) * share)))
    return records[-n:]


def dumps(obj: Any, indent: int | None = None) -> str:
    """JSON with non-finite floats as null (strict JSON readers refuse NaN)."""
    return json.dumps(finite_or_none(obj), indent=indent, default=str)


class Output:
    """The study's ``$OUT`` (see the module docstring)."""

    def __init__(self, out_dir: Path, echo=print) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._echo = echo

    def log(self, line: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {line}"
        self._echo(line)
        with open(self.dir / LOG, "a") as f:
            f.write(line + "\n")

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / SUMMARY
        atomic_write_bytes(path, dumps(summary, indent=1).encode())
        return path

    def write_run(self, name: str, record: dict[str, Any]) -> Path:
        path = self.dir / RUNS_DIR / f"{name}.json.gz"
        # mtime=0: the same record gives the same bytes
        atomic_write_bytes(path, gzip.compress(dumps(record).encode(), compresslevel=6, mtime=0))
        return path


def read_runs(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``runs/<name>.json.gz`` of a study output, by name, in the summary's run order
    when there is a summary."""
    out_dir = Path(out_dir)
    runs = {p.name.removesuffix(".json.gz"): json.loads(gzip.decompress(p.read_bytes()))
            for p in sorted((out_dir / RUNS_DIR).glob("*.json.gz"))}
    order = list(read_summary(out_dir).get("runs", {}))
    return {k: runs[k] for k in [*order, *sorted(set(runs) - set(order))] if k in runs}


def read_summary(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else {}


#: the paper's 182M models (E=8, k=1), quoted from /work/shared/paper/remoe-iclr2025.tex:
#: (source, model, training tokens, validation loss, zero-shot average accuracy %)
PAPER = (
    ("Table 2 (tab:acc_baselines)", "dMoE (TopK)", "30B", None, 39.67),
    ("Table 2 (tab:acc_baselines)", "ReMoE", "30B", None, 40.03),
    ("\"Performance of MoE with near-dense warmup\" (tab:topk_warmup)", "MoE (TopK)", "30B",
     1.936, 39.53),
    ("\"Performance of MoE with near-dense warmup\" (tab:topk_warmup)", "ReMoE", "30B",
     1.921, 40.03),
    ("Table 3 (tab:abl_lambda), lambda0 1e-8, alpha 1.2 (settling time 110 steps)", "ReMoE",
     "~10B (20k steps)", 2.032, None),
)
#: the paper's training scale (Section 4.1): 60k steps of 512 sequences of 1024 tokens
PAPER_BATCH_SEQS, PAPER_SEQ, PAPER_STEPS, PAPER_TOKENS = 512, 1024, 60_000, 30e9


def run_row(rec: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers of one run record (also kept in ``gpu_study.json``)."""
    curve = rec.get("curve") or []
    records = (rec.get("files") or {}).get("metrics.jsonl") or []
    end = rec.get("layers_end") or {}
    tail = last_share(records) if records else []
    eff = [e for e in (end.get("effective_experts") or []) if e is not None]
    summary = (rec.get("files") or {}).get("summary.json") or {}
    model = rec.get("model") or {}
    return {
        "state": rec.get("state"), "steps": rec.get("steps"),
        "planned_steps": rec.get("planned_steps"), "tokens": rec.get("tokens"),
        "flops": rec.get("flops"), "tokens_per_s": rec.get("tokens_per_s"),
        "val_loss": curve[-1]["val_loss"] if curve else None,
        "whole_val_loss": (rec.get("whole_validation") or {}).get("loss"),
        "sparsity_end": (sum(r["sparsity"] for r in tail) / len(tail)) if tail else None,
        "target_sparsity": model.get("target_sparsity"),
        "layer_sparsity_end": end.get("layer_sparsity"),
        "effective_experts_end": end.get("effective_experts"),
        "effective_experts_mean": sum(eff) / len(eff) if eff else None,
        "settling_step": summary.get("settling_step"),
        "params_total": model.get("params_total"), "params_active": model.get("params_active"),
        "vocab_size": model.get("vocab_size"), "error": rec.get("error"), "cut": rec.get("cut"),
    }


def curve_of(name: str, rec: dict[str, Any]) -> Curve | None:
    pts = [e for e in rec.get("curve") or [] if is_number(e.get("val_loss"))]
    if not pts:
        return None
    return Curve(name, np.asarray([e["step"] for e in pts]),
                 np.asarray([float(e["tokens"]) for e in pts]),
                 np.asarray([float(e.get("flops") or math.nan) for e in pts]),
                 np.asarray([float(e["val_loss"]) for e in pts]))


def matched(curves: list[Curve], axis: str) -> tuple[float | None, dict[str, float]]:
    """The smallest final ``axis`` value over the curves and each curve's loss there."""
    ends = [float(c.x(axis)[-1]) for c in curves if np.isfinite(c.x(axis)).all()]
    if not ends:
        return None, {}
    x = min(ends)
    return x, {c.label: float(np.interp(x, c.x(axis), c.val_loss)) for c in curves
               if np.isfinite(c.x(axis)).all() and c.x(axis)[0] <= x}


def markdown(summary: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    """The study's report (module docstring)."""
    dev = (summary.get("device") or {}).get("name", "?")
    st = summary.get("settings") or {}
    data = summary.get("data") or {}
    plan = summary.get("plan") or {}
    rows = {name: run_row(rec) for name, rec in runs.items()}
    curves = [c for name, rec in runs.items() if (c := curve_of(name, rec)) is not None]
    tok_x, at_tok = matched(curves, "tokens")
    flop_x, at_flop = matched(curves, "flops")
    tps = plan.get("tokens_per_step")
    seqs = (st.get("micro_batch") or 0) * (st.get("grad_accum") or 1)
    steps = max((r["steps"] or 0 for r in rows.values()), default=0)
    tokens = max((r["tokens"] or 0 for r in rows.values()), default=0)
    lines = [
        "# GPU study: TopK vs ReMoE at the paper's `small` size", "",
        f"One seed per run: one seed is one seed. Device: {dev} (torch "
        f"{(summary.get('versions') or {}).get('torch')}); {st.get('precision')}, "
        f"{'compiled blocks' if st.get('compile') else 'eager'}; preset `{st.get('preset')}`, "
        f"E=8, k=1, sequence {st.get('seq_len')}. Study state: {summary.get('state')}, "
        f"{num(summary.get('elapsed_s'), '.0f')} s.", "",
        f"Data: the built-in corpus (the CPU studies' store, `{data.get('store')}`), "
        f"{data.get('tokenizer', 'BPE')}: vocabulary {data.get('tokenizer_vocab')} "
        f"(model embedding {data.get('model_vocab')} rows, padded to a multiple of 64), "
        f"{num((data.get('tokens') or {}).get('train'), ',')} training tokens. Not the paper's "
        "data (the Pile) nor its tokenizer, so losses compare between our runs, not with the "
        "paper's in absolute value.", "",
        f"Scale: {steps:,} steps of {seqs} sequences ({num(tps, ',')} tokens per step), "
        f"{tokens:,} tokens per run"
        + (f" ({tokens / max(1, (data.get('tokens') or {}).get('train') or 1):.2f} epochs of "
           "the training split)" if tokens else "")
        + f"; the paper: {PAPER_STEPS:,} steps of {PAPER_BATCH_SEQS} x {PAPER_SEQ} tokens "
        f"({PAPER_TOKENS / 1e9:.0f}B tokens)"
        + (f", {PAPER_TOKENS / tokens:,.0f}x our tokens with a {PAPER_BATCH_SEQS // max(1, seqs)}x"
           " larger batch." if tokens and seqs else "."), "",
        "## Our runs", "",
        f"Validation loss: on the trainer's fixed sample ({st.get('eval_chunks')} sequences per "
        "domain) at the last evaluation, and on the whole validation split after the last "
        f"step; matched tokens: at {num(tok_x, ',.0f')} tokens; matched FLOPs: at "
        f"{num(flop_x, '.3g')} training FLOPs (each curve interpolated). Sparsity and effective "
        "experts (exp of the entropy of a layer's expert token shares; 8 = even) over the last "
        "10% of steps.", "",
        "| run | state | steps | tokens | train FLOPs | tokens/s | val (sample) | val (whole "
        "split) | at matched tokens | at matched FLOPs | sparsity (target) | effective experts "
        "(layer mean) | settled at step | params total / active |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        rec = runs[name]
        state = r["state"] + (f" ({r['cut']})" if r.get("cut") else "") + (
            f" ({r['error'][:80]})" if r.get("error") else "")
        lines.append(
            f"| {rec.get('label', name)} | {state} | {num(r['steps'], ',')} "
            f"| {num(r['tokens'], ',')} | {num(r['flops'], '.3g')} "
            f"| {num(r['tokens_per_s'], ',.0f')} | {num(r['val_loss'], '.4f')} "
            f"| {num(r['whole_val_loss'], '.4f')} | {num(at_tok.get(name), '.4f')} "
            f"| {num(at_flop.get(name), '.4f')} | {num(r['sparsity_end'], '.3f')} "
            f"({num(r['target_sparsity'], '.3f')}) | {num(r['effective_experts_mean'], '.2f')} "
            f"| {num(r['settling_step'], 'd')} | {num((r['params_total'] or 0) / 1e6, '.1f')}M / "
            f"{num((r['params_active'] or 0) / 1e6, '.1f')}M |")
    for name, row in (summary.get("runs") or {}).items():
        if name not in rows and row.get("state") == "skipped":
            lines.append(f"| {row.get('label', name)} | skipped: {row.get('reason')} |"
                         + " – |" * 12)
    lines += ["", "Per layer at the end of each run (sparsity / effective experts):", ""]
    for name, r in rows.items():
        if r["layer_sparsity_end"]:
            pairs = [f"{s_:.2f}/{e_:.1f}" if is_number(s_) and is_number(e_) else "–"
                     for s_, e_ in zip(r["layer_sparsity_end"], r["effective_experts_end"])]
            lines.append(f"- `{name}`: " + ", ".join(pairs))
    lines += ["", "## The paper's 182M models (E=8, k=1), quoted", "",
              f"Trained on the Pile, batch {PAPER_BATCH_SEQS} x {PAPER_SEQ} tokens, 8 A100s "
              "(Section 4.1); validation losses on its own validation data, zero-shot "
              "averages over ARC-c/e, BoolQ, HellaSwag, LAMBADA, PIQA, RACE (not measured "
              "here: no lm-eval on the device).", "",
              "| source (paper) | model | tokens | valid loss | zero-shot avg % |",
              "|---|---|---|---:|---:|"]
    lines += [f"| {src} | {model} | {tok} | {num(loss, '.3f')} | {num(acc, '.2f')} |"
              for src, model, tok, loss, acc in PAPER]
    lines += ["", "The paper's gaps: ReMoE - MoE valid loss -0.015 (tab:topk_warmup); zero-shot "
              "+0.36 (Table 2) / +0.50 (tab:topk_warmup) points.", ""]
    lines += [line.replace("Figure: `curves.png`; every point: `curves.csv`.",
                           "Figure: `gpu_study.png`; every point: `runs/<name>.json.gz`.")
              for line in markdown_section(curves)]
    return "\n".join(lines) + "\n"


def figure(runs: dict[str, dict[str, Any]]):
    """Validation loss against tokens and training FLOPs; sparsity of every step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    target = None
    for name, rec in runs.items():
        c = curve_of(name, rec)
        label = rec.get("label", name)
        if c is not None:
            axes[0].plot(c.tokens, c.val_loss, marker=".", lw=1.2, label=label)
            axes[1].plot(c.flops, c.val_loss, marker=".", lw=1.2, label=label)
        recs = (rec.get("files") or {}).get("metrics.jsonl") or []
        if recs:
            axes[2].plot([r["step"] for r in recs], [r["sparsity"] for r in recs], lw=0.8,
                         label=label)
        target = (rec.get("model") or {}).get("target_sparsity", target)
    for ax, xl in zip(axes[:2], ("tokens", "training FLOPs")):
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (fixed sample)")
        ax.grid(alpha=0.3)
    if target is not None:
        axes[2].axhline(target, color="gray", ls="--", lw=0.8, label="target")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("sparsity (all layers)")
    axes[2].grid(alpha=0.3)
    for ax, size in ((axes[0], 8), (axes[2], 7)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    presets = sorted({(r.get("model") or {}).get("preset") or "?" for r in runs.values()})
    fig.suptitle(f"TopK vs ReMoE, {'/'.join(presets)} preset (E=8, k=1): one seed", fontsize=10)
    fig.tight_layout()
    return fig


def write(src_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """``gpu_study.md`` and ``gpu_study.png`` from ``src_dir``'s JSON files, into ``out_dir``
    (default ``src_dir``). The figure is left out where matplotlib is missing."""
    src_dir = Path(src_dir)
    out_dir = Path(out_dir or src_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = read_summary(src_dir)
    runs = read_runs(src_dir)
    md = out_dir / "gpu_study.md"
    atomic_write_text(md, markdown(summary, runs))
    written = [md]
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig = figure(runs)
    png = out_dir / "gpu_study.png"
    with atomic_open(png, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return written + [png]
