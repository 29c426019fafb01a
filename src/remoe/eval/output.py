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
        out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        _write_csv(out.with_suffix(".csv"), held, columns)
        print(f"wrote {out} and {out.with_suffix('.csv')}", file=sys.stderr)
    return 0
