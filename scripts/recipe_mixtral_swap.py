"""Issue 26's router swap from a transformers Mixtral, after `configs/study/recipes.yaml`.

The recipes study trains a renormalised TopK model (`topk_norm-sS`, what Mixtral computes) and
continues it with a ReLU router (`swap_relu_norm-sS`). This script writes that TopK model as a
transformers Mixtral (`remoe convert to-hf`), then runs the same continued training from the
Mixtral directory (`train.init_from` converts it back on the fly: Mixtral -> remoe `topk` ->
ReLU router on the kept experts), with the study's own config of `swap_relu_norm-sS`. The run's
small outputs are committed under `results/recipes/mixtral/`, and the two runs are printed side
by side: the same weights through two paths should train the same way.

    remoe study configs/study/recipes.yaml --jobs 1
    python scripts/recipe_mixtral_swap.py [--study studies/recipes] [--seed 0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="studies/recipes", help="the recipes study's --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(REPO / "results/recipes/mixtral"))
    args = ap.parse_args(argv)
    study = Path(args.study)
    src = study / "runs" / f"topk_norm-s{args.seed}" / "final"
    cfg = study / "configs" / f"swap_relu_norm-s{args.seed}.yaml"
    ref = study / "runs" / f"swap_relu_norm-s{args.seed}"
    for p in (src, cfg, ref / "summary.json"):
        if not p.exists():
            print(f"recipe_mixtral_swap: {p} is missing: run `remoe study "
                  "configs/study/recipes.yaml` first", file=sys.stderr)
            return 2
    mixtral = study / f"mixtral-topk_norm-s{args.seed}"
    name = f"swap_relu_mixtral-s{args.seed}"
    subprocess.run(["remoe", "convert", "to-hf", str(src), str(mixtral), "--force"], check=True)
    subprocess.run(["remoe", "train", str(cfg), "--no-progress", "--overwrite",
                    "--set", f"train.init_from={mixtral}", "--set", f"run.name={name}"],
                   check=True)

    from remoe.lab.study.archive import export_run
    from remoe.lab.study.continued import continued_row

    run = ref.parent / name
    export_run(run, Path(args.results) / name)
    print(f"committed copy: {Path(args.results) / name}")
    head = ("run", "first LM loss", "val loss, first eval", "val loss, end", "steps to target",
            "final sparsity", "first λ")
    print(" | ".join(head))
    for d in (ref, run):
        c = continued_row(d)
        first = c.get("first_eval")
        print(" | ".join([d.name, f"{c.get('first_lm_loss', float('nan')):.4f}",
                          f"{first[1]:.4f}" if first else "-", f"{c.get('val_loss', 0):.4f}",
                          str(c.get("steps_to_target")), f"{c.get('final_sparsity', 0):.3f}",
                          "/".join(f"{x:.3g}" for x in c.get("lambda_start") or [])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
