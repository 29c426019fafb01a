"""What ``remoe eval`` prints and writes: the loss and zero-shot Markdown tables, the JSON
results document and its one-row-per-model CSV."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any


def _fmt_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def loss_table(models: list[dict[str, Any]], split: str) -> str:
    """Markdown: model, loss, ppl, tokens, then the loss of each domain."""
    domains: list[str] = []
    for m in models:
        for d in (m.get("loss") or {}).get("domains", {}):
            if d not in domains:
                domains.append(d)
    head = ["Model", f"{split} loss", "ppl", "tokens"] + domains
    rows = []
    for m in models:
        res = m.get("loss")
        if not res:
            rows.append([m["name"]] + ["–"] * (len(head) - 1))
            continue
        doms = res["domains"]
        rows.append([m["name"], f"{res['loss']:.4f}", f"{res['ppl']:.2f}", f"{res['tokens']:,}"]
                    + [f"{doms[d]['loss']:.4f}" if d in doms else "–" for d in domains])
    return _fmt_table(head, rows)


def _write_csv(path: Path, models: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    domains: list[str] = []
    for m in models:
        for d in (m.get("loss") or {}).get("domains", {}):
            if d not in domains:
                domains.append(d)
    head = ["model", "path", "loss", "ppl"] + [f"loss_{d}" for d in domains]
    head += [f"{t}:{metric}" for t, _, metric in columns]
    groups = sorted({g for m in models for g in m.get("averages", {})})
    head += [f"avg_{g}" for g in groups]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        for m in models:
            loss = m.get("loss") or {}
            doms = loss.get("domains", {})
            row = [m["name"], m["path"], loss.get("loss", ""), loss.get("ppl", "")]
            row += [doms.get(d, {}).get("loss", "") for d in domains]
            for t, _, metric in columns:
                v = m.get("zero_shot", {}).get(t, {}).get(metric)
                row.append("" if v is None else v)
            row += ["" if m["averages"].get(g) is None else m["averages"][g] for g in groups]
            w.writerow(row)


def _tables(args: argparse.Namespace, models: list[dict[str, Any]],
            columns: list) -> dict[str, str]:
    """The Markdown tables of ``models`` (and their zero-shot averages)."""
    from remoe.eval.zeroshot import BUILTIN_COLUMNS, headline, zero_shot_table

    tables: dict[str, str] = {}
    if not args.no_loss:
        tables["loss"] = loss_table(models, args.split)
    groups = {"standard": [c for c in columns if c[0] not in BUILTIN_COLUMNS],
              "builtin": [c for c in columns if c[0] in BUILTIN_COLUMNS]}
    for g, cols in groups.items():
        if not cols:
            continue
        for m in models:
            m["averages"][g] = headline(m["zero_shot"], cols)["avg"]
        tables[g] = zero_shot_table([(m["name"], m["zero_shot"]) for m in models], cols)
    return tables


TITLES = {"standard": "Zero-shot accuracy (%)",
          "builtin": "Built-in offline tasks, accuracy (%) (* = built from the held-out split, "
                     "not the original benchmark)"}


def _has_loss(m: dict[str, Any]) -> bool:
    return isinstance(m.get("loss"), dict)


def _keep_old_loss(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """A new loss replaces the old one unless it covers less of the same split (a capped
    ``--loss-chunks`` pass never replaces a whole-split one)."""
    if not _has_loss(old):
        return False
    if not _has_loss(new):
        return True
    o, n = old["loss"], new["loss"]
    return (o.get("split") == n.get("split") and o.get("chunks_per_domain") is None
            and n.get("chunks_per_domain") is not None and "chunks_per_domain" in o)


def merge_models(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model name: the new real results over the old ones. A task's score is replaced only
    by a new score of that task (a skipped task is no result); a loss only by a loss that covers
    at least as much of the split; models only in the old file are kept."""
    by_name = {m.get("name"): m for m in old if isinstance(m, dict)}
    merged = []
    for m in new:
        o = by_name.pop(m.get("name"), None)
        if o is None:
            merged.append(m)
            continue
        out = {**o, **{k: v for k, v in m.items()
                       if k not in ("loss", "loss_skipped", "zero_shot", "n_samples",
                                    "zero_shot_skipped", "gate_threshold_sweep", "averages")}}
        if _keep_old_loss(o, m):
            out["loss"], out["loss_skipped"] = o["loss"], None
        else:
            out["loss"], out["loss_skipped"] = m.get("loss"), m.get("loss_skipped")
        now = set(m.get("zero_shot") or {})  # the tasks scored by this run
        for key in ("zero_shot", "n_samples", "zero_shot_skipped"):
            out[key] = {**{t: v for t, v in (o.get(key) or {}).items() if t not in now},
                        **(m.get(key) or {})}
        if m.get("gate_threshold_sweep") is None and o.get("gate_threshold_sweep") is not None:
            out["gate_threshold_sweep"] = o["gate_threshold_sweep"]
        out["averages"] = {}
        merged.append(out)
    return merged + list(by_name.values())


def _merge_doc(old: dict[str, Any], doc: dict[str, Any], args: argparse.Namespace,
               columns: list) -> tuple[dict[str, Any], list, list[dict[str, Any]]]:
    """The results file ``old`` updated with ``doc`` (:func:`merge_models`); columns of tasks
    that hold a score in either are kept; the tables are recomputed."""
    models = merge_models(old.get("models") or [], doc["models"])
    scored = {t for m in models for t in (m.get("zero_shot") or {})}
    cols: dict[str, list] = {}
    for c in [*((old.get("tasks") or {}).get("columns") or []), *map(list, columns)]:
        if isinstance(c, list) and len(c) == 3 and c[0] in scored:
            cols[c[0]] = c
    columns = [tuple(c) for c in cols.values()]
    skipped = {**((old.get("tasks") or {}).get("skipped") or {}),
               **doc["tasks"]["skipped"]}
    doc["tasks"] = {**doc["tasks"], "columns": [list(c) for c in columns],
                    "skipped": {t: w for t, w in skipped.items() if t not in scored},
                    "builtin_manifest": doc["tasks"]["builtin_manifest"]
                    or (old.get("tasks") or {}).get("builtin_manifest")}
    kept = [m for m in models if _has_loss(m)]
    if kept and all("chunks_per_domain" in m["loss"] for m in kept):
        doc["split"] = kept[0]["loss"].get("split")
        doc["loss_chunks_per_domain"] = kept[0]["loss"]["chunks_per_domain"]
    elif args.no_loss:  # no new loss: the old file's description of its loss stands
        doc["split"] = old.get("split")
        doc["loss_chunks_per_domain"] = old.get("loss_chunks_per_domain")
    doc["models"] = models
    view = argparse.Namespace(**{**vars(args), "no_loss": not kept,
                                 "split": doc["split"] or args.split})
    doc["tables"] = _tables(view, models, columns)
    return doc, columns, models


def read_results(path: Path) -> dict[str, Any] | None:
    """An existing results file (None: none); one that does not parse is a ConfigError: it is
    not replaced by a run that cannot merge into it."""
    from remoe.errors import ConfigError

    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} exists but cannot be read ({type(e).__name__}); move it away "
                          "to write new results there") from None
    return old if isinstance(old, dict) else None


def report_results(args: argparse.Namespace, models: list[dict[str, Any]], plan: Any,
            manifest: dict[str, Any] | None, saves: list[tuple[Path, list]] = ()) -> int:
    columns = plan.columns if plan is not None else []
    tables = _tables(args, models, columns)
    if "loss" in tables:
        chunks = (f"at most {args.loss_chunks} sequences per domain" if args.loss_chunks
                  else "the whole split")
        print(f"## Held-out loss ({args.split}, {chunks})\n\n{tables['loss']}\n")
    for g in ("standard", "builtin"):
        if g in tables:
            print(f"## {TITLES[g]}\n\n{tables[g]}\n")
    if plan is not None and plan.skipped:
        print("Skipped: " + ", ".join(sorted(plan.skipped)) + " (see the messages above)\n")
    for out, names in saves:
        held = [m for m in models if m["name"] in names]
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "split": None if args.no_loss else args.split,
            "loss_chunks_per_domain": args.loss_chunks,  # None: the whole split
            "tasks": {"selection": args.tasks,
                      "columns": [list(c) for c in columns],
                      "skipped": plan.skipped if plan is not None else {},
                      "builtin_dir": str(plan.builtin_dir) if plan and plan.builtin_dir else None,
                      "builtin_manifest": manifest,
                      "standard_sources": {s.name: s.source for s in plan.standard if s.source}
                      if plan is not None else {}},
            "limit": args.limit,
            "models": held,
            "tables": tables if len(held) == len(models) else _tables(args, held, columns),
        }
        cols = columns
        old = read_results(out)
        if old is not None:  # merged: earlier results stay unless replaced by real new ones
            doc, cols, held = _merge_doc(old, doc, args, columns)
        from remoe.rundir import atomic_write_text

        atomic_write_text(out, json.dumps(doc, indent=2, default=str) + "\n")
        _write_csv(out.with_suffix(".csv"), held, cols)
        print(f"{'updated' if old is not None else 'wrote'} {out} and "
              f"{out.with_suffix('.csv')}", file=sys.stderr)
    return 0
