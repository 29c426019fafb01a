"""What the GPU study returns, rewritten whole after every evaluation.

A lent GPU machine returns at most 8 files of at most 16 MiB, at most two folders down, and a
command cut off at its time limit returns whatever is on disk then. So ``$OUT`` holds:

```
gpu_study.json          the study so far: device, data, plan, every run's numbers (small)
gpu_study.log           one line per event
gpu_study.md / .png     the table and the figure (remoe.lab.study.gpu_report), after each run
runs/<name>.json.gz     one per run: its learning curve, per-layer sparsity and effective
                        experts per evaluation interval, FLOPs, and the run's small files
                        (metrics.jsonl lines, eval.jsonl lines, summary.json); never weights
```

Every file is written to a temporary name and renamed over the old one, so a cut-off run leaves
the last complete version. Effective experts of a layer: ``exp(H(p))`` with ``p`` the layer's
per-expert token counts (``expert_counts`` of the metrics lines, summed over the interval)
normalised to 1: E when every expert gets the same share, 1 when one expert gets every token.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path
from typing import Any

from remoe.fileio import atomic_write_bytes
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
