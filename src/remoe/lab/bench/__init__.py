"""Benchmarks: one MoE layer, the whole tiny model, and the machine's matmul ceiling.

``remoe bench --suite layer|model|machine|all [--quick] [--out bench_results/<name>.json]``
(or ``python benchmarks/bench_<suite>.py``). See docs/PERFORMANCE.md for the method and results.
"""
