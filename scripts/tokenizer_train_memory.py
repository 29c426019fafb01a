#!/usr/bin/env python3
"""Peak memory of BPE training (remoe's ``train_tokenizer``) against the size of its sample.

    RAYON_NUM_THREADS=1 python scripts/tokenizer_train_memory.py 25e6 100e6 400e6 \
        --out results/data/tokenizer-train-memory.json

The trainer counts every distinct pre-tokenised word, so its memory grows with the number of
distinct words, not with the bytes as such. Text with a fixed vocabulary (the data benchmark's
synthetic Pile, built from Python source lines) would hide that growth, so this script draws
words from a Zipf law (exponent ``--zipf``, 1.4 by default: distinct words grow like n^0.7, as in
natural-language text) over an unbounded vocabulary of letter strings. Each size runs in a fresh
process; its peak is that process's VmHWM. Vocabulary 8,192 as the default data config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, time
import numpy as np
from remoe.data.tokenizer import batched_texts, train_tokenizer
cap, s = int(float(sys.argv[1])), float(sys.argv[2])
rng = np.random.default_rng(0)
letters = "etaoinshrdlcumwfgypbvkjxqz"

def word(i):
    i = i * 2654435761 % (1 << 40) + 1
    out = []
    for _ in range(2 + i % 9):
        out.append(letters[i % 26])
        i = i // 26 or 7
    return "".join(out)

def texts():
    n = 0
    while n < cap:
        t = " ".join(word(int(i)) for i in rng.zipf(s, size=800))
        n += len(t)
        yield t

t0 = time.perf_counter()
train_tokenizer(batched_texts(texts()), 8192)
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print(json.dumps({"sample_bytes": cap, "zipf": s, "wall_s": round(time.perf_counter() - t0, 1),
                  "peak_rss_GB": hwm / 1e6}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="+", type=float, help="sample sizes in bytes (e.g. 25e6)")
    p.add_argument("--zipf", type=float, default=1.4)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    rows = []
    for n in a.sizes:
        r = subprocess.run([sys.executable, "-c", _CHILD, str(n), str(a.zipf)],
                           capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
