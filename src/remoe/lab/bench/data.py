"""The data suite: `remoe data` throughput and peak memory against raw ``tokenizers``.

    remoe bench --suite data --data-input FILE --data-tokenizer tokenizer.json [--workers 1 2]
    remoe bench --suite data --dedup-docs 30000000      # exact deduplication alone

For each worker count N: a fresh ``remoe data`` build of FILE (subprocess; peak RSS is the
largest sum of the resident sets of it and its workers, sampled every 0.1 s; "cores busy" is
the CPU seconds of it and its workers over the wall time), then its
start-up (opening the finished store in a new process), then raw ``tokenizers``
``encode_batch_fast`` of the same text on N threads (1 MB batches, reading excluded). Prints a
table and writes JSON. ``make_pile_like(path, n_bytes)`` writes synthetic Pile-format text.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_RAW = r"""
import json, os, sys, time
from tokenizers import Tokenizer
from remoe.data.userdata import read_jsonl
tok = Tokenizer.from_file(sys.argv[2])
batches, b, n = [], [], 0
for d in read_jsonl(sys.argv[1]):
    b.append(d.text); n += len(d.text)
    if n >= 1 << 20:
        batches.append(b); b, n = [], 0
batches.append(b)
t = time.perf_counter(); toks = 0
for b in batches:
    toks += sum(len(e.ids) for e in tok.encode_batch_fast(b, add_special_tokens=False))
print(json.dumps({"s": time.perf_counter() - t, "tokens": toks}))
"""


def _tree_rss_bytes(pid: int) -> int:
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS of the process tree, CPU seconds of the tree (every core)."""
    cpu0 = _children_cpu_s()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_bytes(proc.pid))
        time.sleep(0.1)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-500:]}")
    return time.perf_counter() - t, peak, _children_cpu_s() - cpu0


def measure(input_path: Path, tokenizer: Path, workers: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    n_bytes = input_path.stat().st_size
    with tempfile.TemporaryDirectory(prefix="remoe-bench-data-") as tmp:
        cmd = [sys.executable, "-m", "remoe.cli", "data", "--source", f"bench={input_path}",
               "--cache-dir", tmp, "--tokenizer", str(tokenizer), "--max-bytes-per-domain",
               str(1 << 50), "--workers", str(workers), "--quiet"]
        wall, peak, cpu = _run_measured(cmd, env)
        open_code = ("import time,sys; t=time.perf_counter(); from remoe.data import "
                     "load_prepared; b=load_prepared(sys.argv[1], verify=False); "
                     "b.split('train'); print(time.perf_counter()-t)")
        start = subprocess.run([sys.executable, "-c", open_code, tmp], env=env,
                               capture_output=True, text=True, check=True)
        m = json.loads(Path(tmp, "store-v2", "manifest.json").read_text())
    tokens = sum(s["num_tokens"] for s in m["tokens"]["splits"].values())
    raw = subprocess.run([sys.executable, "-c", _RAW, str(input_path), str(tokenizer)],
                         env={**env, "RAYON_NUM_THREADS": str(workers)}, capture_output=True,
                         text=True, check=True)
    r = json.loads(raw.stdout.strip().splitlines()[-1])
    text_bytes = sum(v["bytes"] for s in m["corpus"]["splits"].values() for v in s.values())
    return {"input_bytes": n_bytes, "text_bytes": text_bytes, "workers": workers,
            "wall_s": wall, "cpu_s": cpu, "cores_busy": cpu / wall,
            "MB_per_s": text_bytes / wall / 1e6, "tokens_per_s": tokens / wall,
            "peak_rss_GB": peak / 1e9, "startup_s": float(start.stdout.strip().splitlines()[-1]),
            "raw_tokenizers_MB_per_s": text_bytes / r["s"] / 1e6,
            "raw_tokens_per_s": r["tokens"] / r["s"]}


def make_pile_like(path: Path, n_bytes: int, seed: int = 0) -> Path:
    """Synthetic Pile-format ``.jsonl.zst``: shuffled lines of the installed stdlib's ``.py``
    and the Python docs, ~4 KB documents in 8 domains, every document distinct."""
    import random
    import sysconfig

    import zstandard

    rng = random.Random(seed)
    lines: list[str] = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        lines += p.read_text("utf-8", "replace").splitlines()
    cctx = zstandard.ZstdCompressor(level=3)
    written = i = 0
    with open(path, "wb") as raw, cctx.stream_writer(raw) as out:
        while written < n_bytes:
            k = rng.randrange(len(lines) - 80)
            text = f"document {i}\n" + "\n".join(lines[k: k + rng.randrange(40, 160)])
            rec = json.dumps({"text": text, "meta": {"pile_set_name": f"set{i % 8}"}}) + "\n"
            out.write(rec.encode())
            written += len(text.encode())
            i += 1
    return path


_DEDUP = r"""
import json, sys, tempfile, time
import numpy as np
from remoe.data.dedup import SeenFingerprints
n, dup = int(sys.argv[1]), float(sys.argv[2])
rng = np.random.default_rng(0)
with tempfile.TemporaryDirectory(prefix="remoe-bench-dedup-") as tmp:
    seen = SeenFingerprints(tmp)
    t = time.perf_counter(); kept = 0; done = 0
    while done < n:
        fps = rng.integers(0, 1 << 63, size=min(1 << 16, n - done), dtype=np.uint64)
        again = rng.random(fps.shape[0]) < dup  # a repeat of an earlier fingerprint
        fps[again] = fps[rng.integers(0, fps.shape[0], size=int(again.sum()))]
        for fp in fps.tolist():
            if fp not in seen:
                seen.add(fp); kept += 1
        done += fps.shape[0]
    s = time.perf_counter() - t
    disk = sum(p.stat().st_size for p in __import__("pathlib").Path(tmp).glob("*"))
# VmHWM, not ru_maxrss: the latter keeps the forking parent's size across exec
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print(json.dumps({"documents": n, "kept": kept, "s": s, "disk_bytes": disk,
                  "peak_rss_GB": hwm / 1e6}))
"""


def measure_dedup(n_docs: int, dup_share: float = 0.05) -> dict[str, Any]:
    """Exact deduplication alone (:class:`remoe.data.dedup.SeenFingerprints`, default settings)
    over ``n_docs`` random fingerprints, ``dup_share`` of them repeats: documents per second,
    peak RSS, disk. Hashing the text is left out (it is per byte, measured with the build)."""
    r = subprocess.run([sys.executable, "-c", _DEDUP, str(n_docs), str(dup_share)],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["docs_per_s"] = out["documents"] / out["s"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| text | workers | wall s | cores busy | MB/s | tokens/s | raw tokenizers MB/s | "
            "ratio | peak RSS GB | start-up s |\n|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['text_bytes'] / 1e9:.2f} GB | {r['workers']} | {r['wall_s']:.0f} | "
            f"{r.get('cores_busy', float('nan')):.2f} | "
            f"{r['MB_per_s']:.2f} | {r['tokens_per_s'] / 1e6:.2f}M | "
            f"{r['raw_tokenizers_MB_per_s']:.2f} | "
            f"{r['MB_per_s'] / r['raw_tokenizers_MB_per_s']:.2f} | {r['peak_rss_GB']:.2f} | "
            f"{r['startup_s']:.2f} |" for r in rows]
    return "\n".join([head, *body])


def add_data_arguments(p: Any) -> None:
    """The data suite's options (on ``remoe bench`` and on this module's own parser)."""
    p.add_argument("--data-input", type=Path, default=None,
                   help="Pile-format .jsonl(.zst) to build (with --data-tokenizer)")
    p.add_argument("--data-tokenizer", type=Path, default=None,
                   help="an existing tokenizer.json for the build and the raw baseline")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                   help="worker counts to build with (default: 1 2)")
    p.add_argument("--make-bytes", type=int, default=0,
                   help="first write --data-input as this many bytes of synthetic Pile text")
    p.add_argument("--dedup-docs", type=int, nargs="*", default=[], metavar="N",
                   help="also measure exact deduplication alone over N documents")


def run(a: Any, out: Path) -> int:
    """Run the data suite for parsed options ``a``; JSON to ``out``; exit status."""
    if a.data_input is None and not a.dedup_docs:
        raise SystemExit("remoe bench --suite data: --data-input (with --data-tokenizer) or "
                         "--dedup-docs is required")
    if a.data_input is not None and a.data_tokenizer is None:
        raise SystemExit("remoe bench --suite data: --data-tokenizer is required with "
                         "--data-input")
    if a.make_bytes:
        make_pile_like(a.data_input, a.make_bytes)
    rows = ([measure(a.data_input, a.data_tokenizer, w) for w in a.workers]
            if a.data_input is not None else [])
    dedup = [measure_dedup(n) for n in a.dedup_docs]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows + [{"dedup": d} for d in dedup], indent=2) + "\n")
    if rows:
        print(table(rows))
    for d in dedup:
        print(f"dedup: {d['documents']:,} documents ({d['kept']:,} kept) in {d['s']:.0f} s = "
              f"{d['docs_per_s']:,.0f} docs/s, peak RSS {d['peak_rss_GB']:.2f} GB, "
              f"disk {d['disk_bytes'] / 1e9:.2f} GB")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m remoe.lab.bench.data")
    add_data_arguments(p)
    p.add_argument("--out", type=Path, default=Path("bench_results/data.json"))
    a = p.parse_args(argv)
    return run(a, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
