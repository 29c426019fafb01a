#!/usr/bin/env bash
# TopK vs ReMoE at the paper's `small` size in one GPU command of <= 9 minutes
# (src/remoe/lab/study/gpu_study.py; docs/SCALING.md): TopK, ReMoE (recommended control), then,
# if time allows, ReMoE (the paper's controller), the same tokens each, sized from the measured
# throughput to fit --budget-s. Runs from this checkout with the machine's own python3 (nothing
# installed: PYTHONPATH=src). Reads the packed data (--data, default .remoe_cache/gpu_study_pack:
# build it here first with `scripts/gpu_study.sh --build-data`). Writes gpu_study.json, .log,
# .md, .png and runs/<name>.json.gz to $OUT when set, else bench_results/gpu_study/, after every
# evaluation. Without CUDA: a few steps of the same path on CPU (micro model), exit 0.
# `--results-only DIR` rebuilds the table and figure from DIR's JSON files.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m remoe.lab.study.gpu_study "$@"
