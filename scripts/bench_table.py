"""Markdown tables of a ``remoe bench --suite layer`` JSON (the tables in docs/PERFORMANCE.md).

    python scripts/bench_table.py results/perf/layer-idle-1thread.json

Prints the machine line, one row per (case, row) with the median CPU time over rounds, its
spread, the CPU-time ratio to dense [min..max over rounds], wall time, what else kept the cores
busy, peak memory and MFU, then the issue-16 target lines the benchmark judged.
"""

from __future__ import annotations

import json
import sys


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(doc: dict) -> str:
    m = doc["machine"]
    out = [f"Machine: {m['cpu_model']}, {m['cores_logical']} cores, torch {m['torch']}, "
           f"{m['threads']} thread(s), allocator {m['allocator'].split(' ')[0]}; load average "
           f"{m['loadavg_start'][0]} at the start, {m['loadavg_end'][0]} at the end; CPU-bound "
           f"processes started beside it: {m.get('busy_spinners_started', 0)}; "
           f"{doc.get('elapsed_s', 0):.0f} s.", "",
           "| case | row | CPU ms (median of rounds) | +- | **x dense (CPU)** [min..max] | wall ms "
           "| others busy (cores) | peak MB | MFU |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in doc["layer"]["rows"]:
        sp = r.get("vs_dense_cpu_spread") or {}
        rng = f" [{sp['min']:.2f}..{sp['max']:.2f}]" if sp else ""
        busy = ", ".join(f"{b:.1f}" for b in r.get("others_busy_cores") or []) or "-"
        out.append(f"| {r['case']} | {r['row']} | {r['cpu_ms']:.0f} | "
                   f"{100 * (r.get('cpu_rel_spread') or 0):.0f}% | "
                   f"**{_f(r.get('vs_dense_cpu'), '.2f')}**{rng} | {r['wall_ms']:.0f} | {busy} | "
                   f"{_f(r.get('peak_mem_mb'), '.0f')} | {_f(r.get('mfu'), '.2f')} |")
    targets = doc["layer"].get("targets") or []
    if targets:
        out += ["", "| target | value [range over rounds] | verdict |", "|---|---|---|"]
        for t in targets:
            lo, hi = t.get("range") or (None, None)
            rng = f" [{lo:.2f}..{hi:.2f}]" if lo is not None else ""
            out.append(f"| {t['target']} {t['limit']} | {t['value']:.2f}{rng} | "
                       f"{'met' if t['met'] else '**missed**'} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/bench_table.py BENCH.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as fh:
            doc = json.load(fh)
        print(render(doc))
    except (OSError, ValueError, KeyError) as e:
        print(f"bench_table: {argv[0]}: not a remoe bench layer JSON ({e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
