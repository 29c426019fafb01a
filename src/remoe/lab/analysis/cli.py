"""``remoe analyze [WHAT] RUN [RUN ...]``: the paper's analyses of a run, as PNG + CSV/JSON.

WHAT is one of ``all`` (default), ``stages``, ``sparsity``, ``flips``, ``heatmap``,
``specialization``, ``allocation`` (or a comma list, also via ``--what``). Runs after the first
are comparison runs (like ``--compare``): ``remoe analyze flips RUN_A RUN_B`` overlays their
flip rates. Outputs go to ``RUN/analysis/`` (or ``--out``). ``remoe analyze domains RUN
[RUN ...]``: domain specialisation from the routing masks
(:func:`remoe.lab.analysis.domainspec.run_domains`). See docs/ANALYSIS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# light: `remoe analyze --help` is fast
from remoe.lab.analysis.common import ANALYSES, INACTIVE_RULES, Options
from remoe.method.stages import SETTLE_TOL, SETTLE_WINDOW, SMOOTH, STAGE_EPS
from remoe.errors import ConfigError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma list of integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("analyses: " + ", ".join(ANALYSES) + "\nexamples:\n"
                "  remoe analyze runs/tiny-remoe\n"
                "  remoe analyze stages runs/tiny-remoe --settle-tol 0.02\n"
                "  remoe analyze flips runs/remoe runs/moe      (two runs on one plot)\n"
                "  remoe analyze heatmap,allocation runs/tiny-remoe --max-tokens 200000\n"
                "  remoe analyze domains runs/topk runs/remoe --out spec/   (domain "
                "specialisation from the routing masks, with a shuffle null)")
    p.add_argument("items", nargs="+", metavar="[WHAT] RUN",
                   help="optional analysis name(s), then the run directory and comparison runs")
    p.add_argument("--what", default=None, help="comma list of analyses (default: all)")
    p.add_argument("--compare", nargs="+", default=[], metavar="RUN",
                   help="other runs to overlay (flip rates)")
    p.add_argument("--out", default=None, help="output directory (default RUN/analysis)")
    add_analysis_options(p)
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


def add_analysis_options(p: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    """The options of the analyses themselves (shared with ``remoe report``)."""
    g = p.add_argument_group("model-based analyses (heatmap, specialization, allocation)")
    if checkpoint:
        g.add_argument("--checkpoint", default=None,
                       help="model directory (default: the run's final/, else its latest "
                            "checkpoint)")
    g.add_argument("--data", default="auto",
                   help="tokens: auto | validation | calib | FILE.npz (default auto: the "
                        "validation split, else the calibration set)")
    g.add_argument("--data-cache", default=None,
                   help="data cache directory (default: data.cache_dir of the run's config)")
    g.add_argument("--max-tokens", type=int, default=65536, help="tokens to route (default 65536)")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--layers", type=_int_list, default=None,
                   help="MoE layers for the per-domain bars and top-token tables (default: "
                        "first, middle, last)")
    g.add_argument("--min-count", type=int, default=5,
                   help="tokens seen fewer times are left out of token tables (default 5)")
    g.add_argument("--top-tokens", type=int, default=8, help="tokens listed per expert")
    g.add_argument("--recompute", action="store_true",
                   help="ignore a cached routing_stats.npz")
    g.add_argument("--inactive-rule", choices=INACTIVE_RULES, default="fair",
                   help="inactive expert: below a quarter of its fair share k/E of the tokens "
                        "(fair, default) or below 1/64 of them (paper, its Fig. 7)")
    g = p.add_argument_group("stages and sparsity")
    g.add_argument("--settle-tol", type=float, default=SETTLE_TOL,
                   help=f"settling band |S - (1-k/E)| <= tol (default {SETTLE_TOL})")
    g.add_argument("--settle-window", type=int, default=SETTLE_WINDOW,
                   help=f"settled = in the band from the settling step to the end of the log, "
                        f"at least this many steps (default {SETTLE_WINDOW})")
    g.add_argument("--stage-eps", type=float, default=STAGE_EPS,
                   help=f"stage II starts when lambda*L_reg >= eps * L_lm (default {STAGE_EPS})")
    g.add_argument("--smooth", type=int, default=SMOOTH,
                   help=f"trailing moving average of S over this many steps before stage "
                        f"detection (default {SMOOTH}; 1: none)")
    g.add_argument("--skip-steps", type=int, default=100,
                   help="mean/std of sparsity exclude the first steps (default 100, as Fig. 3)")


def parse_items(items: list[str], what_opt: str | None) -> tuple[tuple[str, ...], list[str]]:
    """Split ``[WHAT] RUN [RUN ...]`` into (analyses, runs)."""
    items = list(items)
    what = what_opt
    first = items[0]
    names = first.split(",")
    if not Path(first).exists():
        known = [n in ANALYSES or n == "all" for n in names]
        if all(known):
            if what is not None:
                raise ConfigError(f"analysis given twice: {first!r} and --what={what_opt!r}")
            what = first
            items = items[1:]
        elif "/" not in first and (len(items) > 1 or any(known) or _suggest(names)):
            # `remoe analyze stagez RUN`: a misspelt analysis, not a missing run
            raise ConfigError(_unknown([n for n, ok in zip(names, known) if not ok]))
    if not items:
        raise ConfigError("no run directory given")
    chosen = tuple(ANALYSES) if what in (None, "all") else tuple(
        w.strip() for w in what.split(",") if w.strip())
    bad = [w for w in chosen if w not in ANALYSES]
    if bad:
        raise ConfigError(f"--what={what!r}: " + _unknown(bad))
    return chosen, items


def _suggest(names: list[str]) -> list[str]:
    """Analyses close to the (unknown) ``names``."""
    import difflib

    out: list[str] = []
    for n in names:
        out += [m for m in difflib.get_close_matches(n, list(ANALYSES) + ["all"], n=1, cutoff=0.6)
                if m not in out]
    return out


def _unknown(bad: list[str]) -> str:
    near = _suggest(bad)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return (f"unknown analysis {', '.join(repr(b) for b in bad)}{hint}; choose from "
            f"{', '.join(ANALYSES)}, or all")


def options_from_args(args, what: tuple[str, ...], compare: list[str]) -> Options:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens={args.max_tokens} must be >= 1")
    if args.settle_window < 1:
        raise ConfigError(f"--settle-window={args.settle_window} must be >= 1")
    if args.settle_tol <= 0:
        raise ConfigError(f"--settle-tol={args.settle_tol} must be > 0")
    return Options(what=what, checkpoint=getattr(args, "checkpoint", None), data=args.data,
                   data_cache=args.data_cache, max_tokens=args.max_tokens,
                   batch_size=args.batch_size, layers=args.layers, min_count=args.min_count,
                   top_tokens=args.top_tokens, settle_tol=args.settle_tol,
                   settle_window=args.settle_window, stage_eps=args.stage_eps,
                   smooth=max(1, args.smooth), skip_steps=args.skip_steps,
                   recompute=args.recompute, compare=compare,
                   inactive_rule=args.inactive_rule,
                   mask_step=getattr(args, "mask_step", None))


def run(args) -> int:
    from remoe.lab.analysis.analyze import analyze
    from remoe.lab.analysis.runlog import Run
    from remoe.machine.threads import fix_threads

    if args.items[0] == "domains" and not Path("domains").exists():
        from remoe.lab.analysis.domainspec import run_domains

        return run_domains(args, args.items[1:])  # numpy on the recorded masks, no model
    what, runs = parse_items(args.items, args.what)
    fix_threads("remoe analyze")  # the training policy: all usable cores, fixed; a load hint
    compare = runs[1:] + list(args.compare)
    explicit = args.what is not None or len(what) < len(ANALYSES)
    opts = options_from_args(args, what, compare)
    main = Run(runs[0])
    out = Path(args.out) if args.out else main.path / "analysis"
    print(f"remoe analyze {main.path} -> {out}")
    result = analyze(main, out, opts)
    _print_numbers(result)
    # an analysis asked for and skipped now fails the command (earlier numbers are kept)
    if explicit and (result["skipped"] or set(result.get("kept", ())) & set(what)):
        return 1
    return 0


def _f(v, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def _print_numbers(r: dict) -> None:
    """The headline numbers of an analysis result (NaN already turned into None)."""
    lines = []
    st = r.get("stages")
    sp = r.get("sparsity")
    if st and st["settle_step"] is not None:
        exc = st.get("band_excursions") or []
        left = (f"; it left the band {len(exc)}x before, last at steps {exc[-1][0]}-{exc[-1][1]}"
                if exc else "")
        lines.append(f"settling time {st['settling_time']} steps (stage II from step "
                     f"{st['stage2_start']}, stage III from {st['settle_step']}: sparsity in the "
                     f"band ±{st['tol']:g} from there to the end, smoothed over {st['smooth']}"
                     f"{left})")
    elif st:
        noise = f" (std of S after step {sp['skip_steps']}: {_f(sp['std'])})" if sp else ""
        lines.append(f"not settled: |S - target| <= {st['tol']:g} does not hold over the last "
                     f"{st['window']} or more steps{noise}; for a noisy small-batch run try "
                     "--smooth 10 or a wider --settle-tol")
    lines += [headline(r[key]) for key, headline in _HEADLINES if r.get(key)]
    for line in lines:
        print("  " + line)


def _expert_use_text(ex: dict) -> str:
    """Expert use per layer (``remoe analyze experts``), one line each."""
    train, calib = ex.get("train"), ex.get("calib")
    head = "expert use per layer:"
    if train:
        head += (f" experts/token, effective, never-firing over steps {train['steps'][0]}-"
                 f"{train['steps'][1]} (last 10%);")
    if calib:
        head += (f" no-expert share, inactive ({ex.get('inactive_rule_text')}) on the "
                 f"calibration masks of step {calib['step']}")
    lines = [head]
    for row in ex.get("layers") or []:
        parts = [f"layer {row['layer']}:"]
        if train:
            parts.append(f"{_f(row['experts_per_token'], '.2f')} experts/token, "
                         f"{_f(row['effective_experts'], '.1f')} effective, "
                         f"{_f(row['never_firing'], '.1f')} never-firing;")
        if calib:
            share = row["no_expert_share"]
            parts.append(f"no expert {'n/a' if share is None else format(100 * share, '.1f')}%, "
                         f"{row['inactive']} inactive of {calib['num_experts']}")
        lines.append("  " + " ".join(parts))
    return "\n  ".join(lines)


#: after the stages, the headline of each analysis present in a result, in this order
_HEADLINES = (
    ("sparsity", lambda sp: f"sparsity after step {sp['skip_steps']}: {_f(sp['mean'])} ± "
                            f"{_f(sp['std'])} (target {_f(sp['target'])})"),
    ("flips", lambda fl: f"flip rate mean {_f(fl['mean_flip_rate'])} (flip count "
                         f"{_f(fl['mean_flip_count'], '.3f')}, N={fl['num_experts']})"),
    ("heatmap", lambda hm: f"mean active experts {_f(hm['mean_active_experts'], '.3f')} (target "
                           f"k*G={hm['target_active']}), {hm['num_inactive']} inactive experts "
                           f"({hm.get('inactive_rule_text', '< 1/64 of tokens')})"),
    ("experts", _expert_use_text),
    ("specialization", lambda sc: f"specialisation index {_f(sc['index'])}, domain-expert MI "
                                  f"{_f(sc['mi_bits'])} bits over {sc['num_domains']} domains"),
    ("allocation", lambda al: "Spearman(token frequency, active experts) = "
                              f"{_f(al['spearman_freq_active'], '.3f')}"),
)
