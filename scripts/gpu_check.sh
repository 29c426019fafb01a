#!/usr/bin/env bash
# The GPU measurement in one command (src/remoe/lab/bench/gpu_check.py; docs/SCALING.md): versions,
# bf16 vs fp32, the LM head + loss alone, then dense / TopK / ReLU at the small preset, compiled,
# 64 sequences per optimizer step, ReLU at TopK's pairs per token on the capacity plan and the
# exact one, fused AdamW and the chunked loss, with a profile of one step by kernel category. Runs from this checkout with the machine's own python3 (nothing installed:
# PYTHONPATH=src). Writes gpu_check.json and gpu_check.log to $OUT when set, else to
# bench_results/, after every stage. Without CUDA: one line, exit 0. Extra arguments go to the
# module (--steps, --warmup, --budget-s, --out-dir).
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m remoe.lab.bench.gpu_check "$@"
