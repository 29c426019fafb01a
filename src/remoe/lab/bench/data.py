"""The data suite: `remoe data` throughput and peak memory against raw ``tokenizers``.

    remoe bench --suite data --data-input FILE --data-tokenizer tokenizer.json [--workers 1 2]

For each worker count N: a fresh ``remoe data`` build of FILE (subprocess; peak RSS is the
largest sum of the resident sets of it and its workers, sampled every 0.1 s), then its
start-up (opening the finished store in a new process), then raw ``tokenizers``
``encode_batch_fast`` of the same text on N threads (1 MB batches, reading excluded). Prints a
table and writes JSON. ``make_pile_like(path, n_bytes)`` writes synthetic Pile-format text.
"""

from __future__ import annotations

import json
import os
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


def _run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_bytes(proc.pid))
        time.sleep(0.1)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-500:]}")
    return time.perf_counter() - t, peak, proc.returncode


def measure(input_path: Path, tokenizer: Path, workers: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    n_bytes = input_path.stat().st_size
    with tempfile.TemporaryDirectory(prefix="remoe-bench-data-") as tmp:
        cmd = [sys.executable, "-m", "remoe.cli", "data", "--source", f"bench={input_path}",
               "--cache-dir", tmp, "--tokenizer", str(tokenizer), "--max-bytes-per-domain",
               str(1 << 50), "--workers", str(workers), "--quiet"]
        wall, peak, _ = _run_measured(cmd, env)
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
            "wall_s": wall, "MB_per_s": text_bytes / wall / 1e6, "tokens_per_s": tokens / wall,
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


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| text | workers | wall s | MB/s | tokens/s | raw tokenizers MB/s | ratio | "
            "peak RSS GB | start-up s |\n|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['text_bytes'] / 1e9:.2f} GB | {r['workers']} | {r['wall_s']:.0f} | "
            f"{r['MB_per_s']:.2f} | {r['tokens_per_s'] / 1e6:.2f}M | "
            f"{r['raw_tokenizers_MB_per_s']:.2f} | "
            f"{r['MB_per_s'] / r['raw_tokenizers_MB_per_s']:.2f} | {r['peak_rss_GB']:.2f} | "
            f"{r['startup_s']:.2f} |" for r in rows]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="remoe bench --suite data")
    p.add_argument("--data-input", type=Path, required=True)
    p.add_argument("--data-tokenizer", type=Path, required=True)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--make-bytes", type=int, default=0,
                   help="first write --data-input as this many bytes of synthetic Pile text")
    p.add_argument("--out", type=Path, default=Path("bench_results/data.json"))
    a = p.parse_args(argv)
    if a.make_bytes:
        make_pile_like(a.data_input, a.make_bytes)
    rows = [measure(a.data_input, a.data_tokenizer, w) for w in a.workers]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
