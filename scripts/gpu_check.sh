#!/usr/bin/env bash
# The GPU measurement in one command (src/remoe/lab/bench/gpu_check.py; docs/SCALING.md): versions,
# bf16 vs fp32, then dense / TopK / ReLU at the small preset, eager and compiled, ReLU's exact
# plan last. Runs from this checkout with the machine's own python3 (nothing installed:
# PYTHONPATH=src). Writes gpu_check.json and gpu_check.log to $OUT when set, else to
# bench_results/, after every stage. Without CUDA: one line, exit 0. Extra arguments go to the
# module (--steps, --warmup, --micro-batch, --budget-s, --out-dir).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m remoe.lab.bench.gpu_check "$@"
