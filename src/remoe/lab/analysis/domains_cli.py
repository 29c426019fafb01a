"""``remoe analyze domains RUN [RUN ...]``: writes, into ``--out`` (default the first run's
``analysis/``): ``domain_routing.csv``, ``specialisation.csv``, ``specialisation_steps.csv``,
``specialisation.json``, ``specialisation_<source>.png`` and ``domain_routing_<run>_<source>.png``
(sources ``calib`` and ``train``: :mod:`remoe.lab.analysis.domainspec`)."""

from __future__ import annotations

import re
from pathlib import Path

from remoe.errors import ConfigError

NAME = "domains"


def add_arguments(p) -> None:
    g = p.add_argument_group("domains (domain specialisation from the routing masks)")
    g.add_argument("--shuffles", type=int, default=1000,
                   help="permutations of the sequences' domains for the null (default 1000)")
    g.add_argument("--shuffle-seed", type=int, default=0, help="seed of the permutations")
    g.add_argument("--mask-step", type=int, default=None,
                   help="the recorded step to analyse (default: the last); `experts` then "
                        "reads the training steps up to it and that step's masks")
    g.add_argument("--train-steps", type=int, default=600,
                   help="last logged steps regressed on their batches' domains (default 600; "
                        "0: the calibration masks only)")


def run(args, paths: list[str]) -> int:
    from remoe.lab.analysis import plots
    from remoe.lab.analysis.common import rel_files, write_csv, write_json
    from remoe.lab.analysis.domainspec import (analyze_domains, routing_rows, run_record,
                                               step_rows, test_rows)
    from remoe.lab.analysis.plots_domains import fig_specialisation
    from remoe.lab.analysis.plots_routing import fig_specialization
    from remoe.lab.analysis.runlog import Run

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
        print(f"  {rec['run']:<14} {rec['source']:<5} step {rec['step']}: MI per layer {per}; layer mean "
              f"{m['observed']:.3f} bits, null {m['null_mean']:.3f} ± {m['null_std']:.3f}, "
              f"z {m['z']:.2f}, p {m['p']:.3g} (floor {rec['p_floor']:.2g})")
    print("  " + ", ".join(rel_files(files, out)))
    return 0
