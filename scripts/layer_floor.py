"""The floor of an MoE layer's training step on this machine, from the library's own kernels.

For a `remoe bench --suite layer` case (T tokens, width D, E experts, granularity G, k), times
the work any token-choice MoE layer built from torch's CPU kernels must do in one
forward+backward, each piece on its own with hot caches, on one thread:

* expert GEMMs: the six matmuls of a SwiGLU expert forward+backward, as ``torch.bmm`` over
  exactly balanced, pre-gathered blocks of ``T k G / N`` rows per expert, in cache-sized chunks
  of experts (as the fused kernel walks them), plus SwiGLU's elementwise work;
* gather / scatter: the three ``index_select`` (x forward; x and dy backward) and two
  ``index_add_`` (y forward; dx backward) of the ``P = T k G`` active pairs' rows;
* router: the ``[T, D] @ [D, N]`` logits GEMM and its two backward GEMMs;

against the bench's ``dense`` row (a dense SwiGLU of the active width, forward+backward).
The sum is optimistic (no routing imbalance, no plan, hot caches): a layer built from these
kernels is not expected below ``floor / dense`` beyond the round-to-round spread of the
measurements. Usage:

    python scripts/layer_floor.py --experts 8 128 --granularity 1 64 [--json OUT]

Like the bench, it runs under tcmalloc when installed (``--allocator``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from remoe.machine import allocator
from remoe.lab.bench.common import loadavg, machine_info, spread, time_interleaved
from remoe.lab.bench.layer import LayerCase, build_rows, step_fn
from remoe.model.dispatch import fused_rows


def pieces(case: LayerCase, seed: int = 0) -> dict:
    """``{piece: callable}`` for one case (each callable does that piece of one fwd+bwd); the
    ``dense`` piece is the bench's own ``dense`` row."""
    x, ctx, mods = build_rows(case, rows=("dense",), seed=seed)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(x.shape, generator=g)
    T, D, N, H = case.T, case.d_model, case.N, case.H
    P = T * case.k * case.G
    m = P // N  # rows per expert, exactly balanced
    chunk = max(1, min(N, fused_rows(D, H) // max(1, m)))  # experts per cache-sized chunk
    w_in = torch.randn(N, D, 2 * H, generator=g) * 0.02
    w_out = torch.randn(N, H, D, generator=g) * 0.02
    xg = torch.randn(chunk, m, D, generator=g)
    dyg = torch.randn(chunk, m, D, generator=g)
    dw_in, dw_out = torch.empty_like(w_in), torch.empty_like(w_out)

    def expert_gemms():
        for e0 in range(0, N, chunk):
            n = min(chunk, N - e0)
            wi, wo, a_x, a_dy = w_in[e0:e0 + n], w_out[e0:e0 + n], xg[:n], dyg[:n]
            h = torch.bmm(a_x, wi)
            s = F.silu(h[..., :H])
            a = s * h[..., H:]
            torch.bmm(a, wo)
            dz = torch.bmm(a_dy, wo.transpose(1, 2))
            torch.bmm(a.transpose(1, 2), a_dy, out=dw_out[e0:e0 + n])
            dh = torch.cat([torch.ops.aten.silu_backward(dz * h[..., H:], h[..., :H]), dz * s], -1)
            torch.bmm(a_x.transpose(1, 2), dh, out=dw_in[e0:e0 + n])
            torch.bmm(dh, wi.transpose(1, 2))

    # token of each pair, grouped by expert (tokens ascending inside a group, as dispatch.plan)
    tok = torch.cat([torch.randperm(T, generator=g)[:m].sort().values for _ in range(N)])
    x2, dy2 = x.reshape(T, D), gy.reshape(T, D)
    rows = chunk * m
    buf, acc = torch.empty(rows, D), torch.zeros(T, D)

    def gather_scatter():
        for r0 in range(0, P, rows):
            t = tok[r0:r0 + rows]
            b = buf[:t.numel()]
            torch.index_select(x2, 0, t, out=b)
            acc.index_add_(0, t, b)  # y
            torch.index_select(x2, 0, t, out=b)
            torch.index_select(dy2, 0, t, out=b)
            acc.index_add_(0, t, b)  # dx

    w_r = torch.randn(D, N, generator=g) * 0.02
    dlogits = torch.randn(T, N, generator=g)

    def router():
        x2 @ w_r
        dlogits @ w_r.t()
        x2.t() @ dlogits

    return {"dense": step_fn(mods["dense"], x, ctx, gy), "expert_gemms": expert_gemms,
            "gather_scatter": gather_scatter, "router": router}


def measure(case: LayerCase, reps: int = 5, rounds: int = 3) -> dict:
    """Median CPU ms of each piece over ``rounds`` (each round: ``reps`` calls of every piece,
    interleaved by :func:`remoe.lab.bench.common.time_interleaved`) and the floor's ratio to
    ``dense``: the median of the per-round ratios, with their range."""
    fns = pieces(case)
    per_round = {k: [] for k in fns}
    for _ in range(rounds):
        for k, smp in time_interleaved(fns, reps).items():
            per_round[k].append(1e3 * smp.cpu)
    rest = [k for k in fns if k != "dense"]
    ratios = {k: [v / d for v, d in zip(per_round[k], per_round["dense"])] for k in rest}
    ratios["floor"] = [sum(per_round[k][i] for k in rest) / per_round["dense"][i]
                       for i in range(rounds)]
    ms = {k: statistics.median(v) for k, v in per_round.items()}
    floor = spread(ratios["floor"])
    return {"case": case.name, "cpu_ms": ms, "floor_ms": sum(ms[k] for k in rest),
            "vs_dense": {k: statistics.median(v) for k, v in ratios.items()},
            "floor_vs_dense_range": [floor["min"], floor["max"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    p.add_argument("--granularity", type=int, nargs="+", default=[1, 64])
    p.add_argument("--tokens", type=int, default=LayerCase.T, help="T (default: the bench's)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--allocator", choices=allocator.MODES, default="auto",
                   help="host allocator, as `remoe bench --allocator` (default: auto)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    alloc = allocator.configure(args.allocator, "layer_floor.py")
    torch.set_num_threads(1)
    out = []
    for E in args.experts:
        for G in args.granularity:
            if E > 8 and G > 1:
                continue  # the bench's cases: E x G = 8 x 64 at most
            r = measure(LayerCase(T=args.tokens, E=E, G=G), args.reps, args.rounds)
            out.append(r)
            v = r["vs_dense"]
            lo, hi = r["floor_vs_dense_range"]
            print(f"{r['case']}: floor {v['floor']:.2f}x dense [{lo:.2f}..{hi:.2f}]: expert GEMMs "
                  f"{v['expert_gemms']:.2f}, gather/scatter {v['gather_scatter']:.2f}, router "
                  f"{v['router']:.2f}  (dense {r['cpu_ms']['dense']:.0f} ms CPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {**machine_info(alloc), "loadavg_end": loadavg()},
                       "metric": "cpu_ms (median)", "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
