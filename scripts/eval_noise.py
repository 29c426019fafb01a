#!/usr/bin/env python3
"""How noisy is the trainer's validation loss? (issue 25; a measurement, not a test)

    python scripts/eval_noise.py RUN_A [RUN_B] [--sizes 8 16 32 64] [--out FILE.json]

Loads each run's latest checkpoint (or final/), computes the loss of every validation chunk of
the run's data (``train.seq_len`` tokens each), and reports, for each ``eval_chunks_per_domain``
in ``--sizes``: the fixed sample's loss (the evenly spaced chunks the trainer takes), its
distance from the whole split's loss, and the standard error of a sample of that size
(sqrt(sum_d var_d / n) / D over the D domains, var_d the per-chunk variance of domain d). With
two runs: the same for the *difference* A - B on the same chunks (paired), which is what a
comparison of two runs at one evaluation suffers. Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def chunk_losses(run: Path, cache: Path | None) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    """(loss of every validation chunk [C], its domain [C], domain names, run config)."""
    import yaml

    from remoe.data import load_prepared
    from remoe.data.sampler import eval_chunk_indices
    from remoe.rundir.loading import load_model

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    seq_len = int(cfg["train"]["seq_len"])
    bundle = load_prepared(cache or Path(cfg["data"]["cache_dir"]), verify=False)
    store = bundle.split("validation")
    table = store.chunks(seq_len)
    ids = eval_chunk_indices(table, len(store.domains), None)
    model = load_model(run)[0].eval()
    losses, domains = [], []
    with torch.no_grad():
        for i in range(0, ids.size, 16):
            b = store.gather(table, ids[i:i + 16])
            x = torch.as_tensor(b[0]).long()
            logits = model(input_ids=x[:, :-1]).logits
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                  x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)
            losses.append(nll.double().mean(1).numpy())
            domains.append(np.asarray(b[1]).reshape(-1))
    return np.concatenate(losses), np.concatenate(domains), list(store.domains), cfg


def sample_table(loss_C: np.ndarray, dom_C: np.ndarray, names: list[str],
                 sizes: list[int]) -> list[dict]:
    """The fixed sample of each size against the whole split (chunk order is the store's)."""
    D = len(names)
    whole = float(np.mean([loss_C[dom_C == d].mean() for d in range(D)]))
    var_D = np.asarray([loss_C[dom_C == d].var(ddof=1) for d in range(D)])
    rows = []
    for n in sizes:
        picked = []
        for d in range(D):
            idx = np.flatnonzero(dom_C == d)
            m = idx.size
            if m > n:
                idx = idx[((2 * np.arange(n) + 1) * m) // (2 * n)]
            picked.append(float(loss_C[idx].mean()))
        fixed = float(np.mean(picked))
        rows.append({"chunks_per_domain": n, "fixed_sample": fixed, "minus_whole": fixed - whole,
                     "std_error": float(np.sqrt(var_D.sum() / n) / D)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="one or two run directories")
    p.add_argument("--sizes", nargs="+", type=int, default=[8, 16, 32, 64])
    p.add_argument("--data-cache", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if len(a.runs) > 2:
        p.error("give one or two runs")
    torch.set_num_threads(1)
    cache = Path(a.data_cache) if a.data_cache else None
    got = [chunk_losses(Path(r), cache) for r in a.runs]
    loss_C, dom_C, names, cfg = got[0]
    doc = {"runs": a.runs, "seq_len": cfg["train"]["seq_len"], "domains": names,
           "chunks_per_domain": {n: int((dom_C == d).sum()) for d, n in enumerate(names)},
           "whole_split": float(np.mean([loss_C[dom_C == d].mean() for d in range(len(names))])),
           "per_run": sample_table(loss_C, dom_C, names, a.sizes)}
    if len(got) == 2:
        diff = loss_C - got[1][0]
        doc["difference"] = sample_table(diff, dom_C, names, a.sizes)
        doc["whole_split_difference"] = float(np.mean([diff[dom_C == d].mean()
                                                       for d in range(len(names))]))
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
