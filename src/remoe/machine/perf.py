"""The machine's measured fp32 matmul ceiling, and model FLOPs utilisation (MFU) against it.

Used by ``remoe bench`` and ``remoe study --dry-run`` (the ceiling over several shapes:
:func:`matmul_ceiling`) and by the end-of-run summary of
``remoe train`` (a quick one: best of a few 1024^3 ``torch.mm`` at the run's thread count, about
0.1-0.3 s). MFU = model FLOPs per second / ceiling FLOP/s. Both are wall-clock rates measured on
the same machine in the same conditions, so on a shared machine the ceiling drops with the load
as the run's own rate does; the summary also records the load average.
"""

from __future__ import annotations

import time

import torch


def matmul_gflops(m: int, k: int, n: int, reps: int = 3) -> tuple[float, float]:
    """Best fp32 ``torch.mm`` rate of ``[m, k] @ [k, n]`` over ``reps`` calls after a warm-up:
    ``(GFLOP per wall second, GFLOP per process-CPU second)``."""
    g = torch.Generator().manual_seed(0)  # the global RNG stays untouched (bit-exact runs)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)
    best_w = best_c = float("inf")
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        torch.mm(a, b, out=out)
        w1, c1 = time.perf_counter(), time.process_time()
        best_w, best_c = min(best_w, w1 - w0), min(best_c, max(c1 - c0, 1e-9))
    flops = 2.0 * m * k * n
    return flops / best_w / 1e9, flops / best_c / 1e9


#: the shapes of the full ceiling: square ones and the FFN-like ones of the benchmarks
CEILING_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 256, 2048), (4096, 1024, 256))


def matmul_ceiling(quick: bool = False, reps: int = 5) -> dict:
    """The machine's fp32 ``torch.mm`` ceiling: the best rate over :data:`CEILING_SHAPES`
    (``quick``: one 512^3 product), per wall second and per process-CPU second (the ceiling of
    one busy core at one thread). The one ceiling of remoe: ``remoe bench`` reports it, study
    estimates (``remoe study --dry-run``) divide by it, the run summary's MFU uses
    :func:`quick_ceiling_gflops`."""
    shapes = ((512, 512, 512),) if quick else CEILING_SHAPES
    rows = []
    for m, k, n in shapes:
        wall, cpu = matmul_gflops(m, k, n, reps=2 if quick else reps)
        rows.append({"m": m, "k": k, "n": n, "gflops": wall, "gflops_per_cpu_s": cpu})
    return {"matmul_fp32_gflops": max(r["gflops"] for r in rows),
            "matmul_fp32_gflops_per_cpu_s": max(r["gflops_per_cpu_s"] for r in rows),
            "shapes": rows}


def quick_ceiling_gflops() -> float:
    """A quick fp32 matmul ceiling (GFLOP/s, wall) at the current thread count: one 1024^3
    product (0.1-0.3 s), for the end-of-run summary."""
    return matmul_gflops(1024, 1024, 1024)[0]


def mfu(flops: float, seconds: float, ceiling_gflops: float, processes: int = 1) -> float | None:
    """Model FLOPs utilisation of ``flops`` done in ``seconds`` by ``processes`` processes,
    each with ``ceiling_gflops`` available."""
    if not seconds or not ceiling_gflops or seconds <= 0:
        return None
    return flops / seconds / 1e9 / (ceiling_gflops * max(1, processes))
