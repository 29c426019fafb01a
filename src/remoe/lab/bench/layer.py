"""Layer suite: forward+backward time and peak tensor memory of one FFN slot on identical inputs.

Rows per (T, d_model, d_ffn, E, G, k):

* ``dense``: a dense SwiGLU of the *active* width ``d_ffn * k`` (the floor an MoE layer can reach);
* ``relu``: our :class:`~remoe.model.moe.MoELayer` with the ReLU router at its target sparsity
  ``1 - k/E``, default (fused) expert backend; steady state is forced by a calibrated per-expert
  router bias (see :func:`force_relu_density`);
* ``relu_unfused``: the same layer and routing on the unfused ``grouped_mm`` backend
  (nonzero-sort + ``F.grouped_mm`` + ``index_add_``: the pre-optimisation path);
* ``topk``: our MoELayer with the TopK router (k*G of E*G experts per token), brought to the
  balanced load its load-balancing loss aims at by a calibrated per-expert bias
  (:func:`balance_topk_bias`; random init routing is ~10-50% imbalanced at E >= 32);
* ``hf_eager`` / ``hf_grouped_mm``: transformers' ``MixtralSparseMoeBlock`` with our TopK layer's
  weights copied in, with its ``eager`` experts implementation (what a stand-alone block runs)
  and its ``grouped_mm`` one (what ``MixtralForCausalLM`` resolves to by default in
  transformers 5.x); same shapes, weights and balanced top-k routing as ``topk`` (Mixtral
  renormalises the k gates).
"""

from __future__ import annotations

import statistics
import types
from dataclasses import asdict, dataclass

import torch

from remoe.lab.bench.common import (OthersMeter, loadavg, peak_tensor_memory, spread,
                                time_interleaved)
from remoe.model.moe import DenseFFN, MoEConfig, MoELayer
from remoe.model.routers import RouterContext

ROWS = ("dense", "relu", "topk", "relu_unfused", "hf_eager", "hf_grouped_mm")
#: stage I (every expert active) against its floor, a dense FFN E times as wide (``--rows``)
STAGE1_ROWS = ("dense_wide", "relu_stage1")
KNOWN_ROWS = ROWS + STAGE1_ROWS


@dataclass
class LayerCase:
    T: int = 4096
    d_model: int = 256
    d_ffn: int = 1024
    E: int = 8
    G: int = 1
    k: int = 1
    seq_len: int = 1024

    @property
    def N(self) -> int:
        return self.E * self.G

    @property
    def H(self) -> int:
        return self.d_ffn // self.G

    @property
    def name(self) -> str:
        return f"E={self.E} G={self.G} k={self.k}"


def force_relu_density(layer: MoELayer, x_TD: torch.Tensor, density: float) -> torch.Tensor:
    """Make exactly ``round(T * density)`` tokens of ``x_TD`` activate every expert.

    The ReLU router has no bias; we give it one for the benchmark: ``logits - b_e`` with ``b_e``
    the per-expert order statistic of the logits on ``x_TD``. That is ReMoE's steady state
    (stage III with perfect load balance): sparsity exactly ``1 - k/E``, every expert
    ``T k / E`` tokens, a varying number of experts per token. Returns ``b``.
    """
    router = layer.router
    with torch.no_grad():
        logits = router.logits(x_TD)
    T = logits.shape[0]
    keep = int(round(T * density))
    if keep >= T:
        b = logits.min(0).values - 1.0
    elif keep <= 0:
        b = logits.max(0).values + 1.0
    else:
        b = logits.kthvalue(T - keep, dim=0).values  # exactly `keep` values lie above it
    _bias_router_logits(router, b)
    return b


def balance_topk_bias(logits_TN: torch.Tensor, k: int, iters: int = 80) -> torch.Tensor:
    """A per-expert bias ``b`` with ``topk(logits - b, k)`` close to perfectly load-balanced.

    Iterative price adjustment: overloaded experts raise their price, idle ones lower it, with
    a decaying step. TopK's load-balancing loss aims at this state; forcing it makes the TopK
    rows comparable with the (exactly balanced) ReLU rows.
    """
    T, N = logits_TN.shape
    target = T * k / N
    b = torch.zeros(N)
    step = float(logits_TN.std()) * 0.5
    for _ in range(iters):
        idx = (logits_TN - b).topk(k, dim=1).indices
        counts = torch.bincount(idx.reshape(-1), minlength=N).float()
        b += step * (counts - target) / target
        step *= 0.95
    return b


def _bias_router_logits(router, b: torch.Tensor) -> None:
    base = type(router).logits

    def logits_with_bias(self, x):
        return base(self, x) - b

    router.logits = types.MethodType(logits_with_bias, router)


def _hf_biased_router(gate, b: torch.Tensor) -> None:
    """Give a Mixtral router the same bias: top-k of ``x W - b``, gates = softmax over the k."""

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = torch.nn.functional.linear(h, self.weight) - b
        top_i = logits.topk(self.top_k, dim=-1).indices
        top_w = torch.softmax(logits.float().gather(1, top_i), dim=-1)
        return logits, top_w.to(h.dtype), top_i

    gate.forward = types.MethodType(forward, gate)


def _hf_block(layer: MoELayer, case: LayerCase, impl: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=case.d_model, intermediate_size=case.H,
                        num_local_experts=case.N, num_experts_per_tok=case.k * case.G,
                        router_jitter_noise=0.0, hidden_act="silu")
    cfg._experts_implementation = impl
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.w_in_ND2H.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_out_NHD.transpose(1, 2))
    block.train()
    return block


def _moe_cfg(case: LayerCase, router: str, backend: str = "auto") -> MoEConfig:
    return MoEConfig.build(d_model=case.d_model, d_ffn=case.d_ffn, num_experts=case.E, top_k=case.k,
                     granularity=case.G, router=router, expert_backend=backend)


def _flops_fwd_bwd(case: LayerCase, pairs: float, dense_width: int | None = None) -> float:
    """Model FLOPs of one forward+backward (3x forward): SwiGLU matmuls (+ router logits).
    ``dense_width``: a dense SwiGLU of that hidden width instead."""
    if dense_width is not None:
        return 3 * 6 * case.T * case.d_model * dense_width
    return 3 * (6 * pairs * case.d_model * case.H + 2 * case.T * case.d_model * case.N)


def dense_width(case: LayerCase, row: str) -> int | None:
    """Hidden width of a dense row (``dense``: the active width; ``dense_wide``: all experts')."""
    return {"dense": case.d_ffn * case.k, "dense_wide": case.d_ffn * case.E}.get(row)


def build_rows(case: LayerCase, rows: tuple[str, ...] = ROWS, seed: int = 0):
    """``{row: (module, call)}`` on shared inputs, where ``call(module, x)`` returns ``(y, aux_loss)``."""
    torch.manual_seed(seed)
    B = max(1, case.T // case.seq_len)
    S = case.T // B
    x = torch.randn(B, S, case.d_model)
    ctx = RouterContext(batch_size=B, seq_len=S)
    mods = {}
    if "dense" in rows:
        mods["dense"] = DenseFFN(MoEConfig.build(d_model=case.d_model, d_ffn=case.d_ffn * case.k,
                                           num_experts=case.E, top_k=case.k, router="dense"))
    if "dense_wide" in rows:  # stage I's floor: all E x d_ffn of hidden width, dense
        mods["dense_wide"] = DenseFFN(MoEConfig.build(d_model=case.d_model, d_ffn=case.d_ffn * case.E,
                                                num_experts=case.E, top_k=case.k, router="dense"))
    if "relu_stage1" in rows:  # ReMoE's stage I: every expert active for every token
        torch.manual_seed(seed + 1)
        mods["relu_stage1"] = MoELayer(_moe_cfg(case, "relu"))
        force_relu_density(mods["relu_stage1"], x.reshape(-1, case.d_model), 1.0)
    relu = None
    if {"relu", "relu_unfused"} & set(rows):
        torch.manual_seed(seed + 1)
        relu = MoELayer(_moe_cfg(case, "relu"))
        force_relu_density(relu, x.reshape(-1, case.d_model), case.k / case.E)
        if "relu" in rows:
            mods["relu"] = relu
        if "relu_unfused" in rows:
            unf = MoELayer(_moe_cfg(case, "relu", backend="grouped_mm"))
            unf.load_state_dict(relu.state_dict())
            force_relu_density(unf, x.reshape(-1, case.d_model), case.k / case.E)
            mods["relu_unfused"] = unf
    topk = None
    if {"topk", "hf_eager", "hf_grouped_mm"} & set(rows):
        torch.manual_seed(seed + 2)
        topk = MoELayer(_moe_cfg(case, "topk"))
        with torch.no_grad():
            b = balance_topk_bias(topk.router.logits(x.reshape(-1, case.d_model)), case.k * case.G)
        _bias_router_logits(topk.router, b)
        if "topk" in rows:
            mods["topk"] = topk
        for impl in ("eager", "grouped_mm"):
            if f"hf_{impl}" in rows:
                mods[f"hf_{impl}"] = _hf_block(topk, case, impl)
                _hf_biased_router(mods[f"hf_{impl}"].gate, b)
    for row in rows:  # any other registered token router (remoe.model.registry), as initialised
        if row not in mods and row not in KNOWN_ROWS:
            from remoe.model import registry

            if not registry.is_token_router(row):
                raise ValueError(f"--rows {row!r} is not a token router")
            torch.manual_seed(seed + 3)
            mods[row] = MoELayer(_moe_cfg(case, row))
    return x, ctx, mods


def step_fn(mod, x, ctx, gy):
    """One forward+backward of a row's module on ``x`` against the output gradient ``gy``
    (parameter and input gradients dropped after each call, as in training)."""
    xg = x.detach().requires_grad_(True)
    params = list(mod.parameters())
    is_hf = not isinstance(mod, (MoELayer, DenseFFN))

    def step():
        if is_hf:
            y = mod(xg)
            loss = (y * gy).sum()
        else:
            y, aux = mod(xg, ctx)
            loss = (y * gy).sum() + aux.reg_loss + aux.aux_loss
        loss.backward()
        xg.grad = None
        for p in params:
            p.grad = None

    return step


def _routing_stats(mod: MoELayer, x, ctx) -> dict:
    with torch.no_grad():
        r = mod.router(x.reshape(-1, x.shape[-1]), ctx)
    counts = r.mask_TN.sum(0).float()
    per_token = r.mask_TN.sum(1).float()
    return {"sparsity": 1.0 - float(r.mask_TN.float().mean()),
            "pairs": int(r.mask_TN.sum()),
            "tokens_per_expert_min": int(counts.min()), "tokens_per_expert_max": int(counts.max()),
            "experts_per_token_mean": float(per_token.mean()),
            "experts_per_token_max": int(per_token.max()),
            "idle_tokens": int((per_token == 0).sum())}


def measure_row(case: LayerCase, row: str, reps: int, memory: bool = True,
                slow_s: float = 20.0) -> dict:
    """Time one row of one case (``reps`` calls after one warm-up; medians) and, unless it is
    slower than ``slow_s``, measure its peak tensor memory. Returns samples + routing stats +
    the load beside it (load average, cores other processes kept busy during the calls)."""
    x, ctx, mods = build_rows(case, (row,))
    mod = mods[row]
    fn = step_fn(mod, x, ctx, torch.randn_like(x))
    load = loadavg()
    meter = OthersMeter()
    meter.start()
    s = time_interleaved({row: fn}, reps=reps, warmup=1, slow_s=slow_s)[row]
    out = s.as_dict()
    out["others_busy_cores"], out["loadavg"] = meter.stop(), load
    out["wall_s"], out["cpu_s"] = s.wall, s.cpu
    if isinstance(mod, MoELayer):
        out.update(_routing_stats(mod, x, ctx))
    out["peak_mem_mb"] = None
    if memory and min(s.wall, s.cpu) < slow_s:  # the profiler pass would repeat a long call
        out["peak_mem_mb"] = peak_tensor_memory(fn) / 2**20
    return out


def run_here(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _paired(rounds_a: list, rounds_b: list) -> list[float]:
    """Per-round ratios ``a_i / b_i`` (rows measured close in time), or the ratio of medians
    when the two rows have different numbers of rounds (a slow row runs one round only)."""
    if len(rounds_a) == len(rounds_b):
        return [a / b for a, b in zip(rounds_a, rounds_b)]
    return [statistics.median(rounds_a) / statistics.median(rounds_b)]


def run_case(case: LayerCase, reps: int, ceiling_gflops: float | None, rows=ROWS,
             memory: bool = True, slow_s: float = 20.0, use_cpu: bool = False,
             log=print, runner=run_here, rounds: int = 1) -> list[dict]:
    """Measure every row of one case; returns one dict per row.

    ``rounds`` rounds; in each, every row is measured once by ``runner(measure_row, case, row,
    ...)``, the rows in an order rotated by one every round, so that a slow spell of a shared
    machine hits every row alike. In-process by default; ``remoe bench`` passes a runner that
    uses a fresh process per measurement, because rows that allocate gigabytes per step (the
    unfused path, transformers' blocks at G=64) leave the allocator in a state that slowed the
    *dense* row 2x when all rows shared a process. A row whose first round is slower than
    ``slow_s`` (the smaller of wall and CPU time) runs that round only. Per row: the median
    over rounds of each round's median, the per-round values, and their spread; ratios to
    dense are the median of per-round ratios. Peak memory is measured in the first round. ``mfu``: model FLOPs per second over
    ``ceiling_gflops``, per wall second or, with ``use_cpu``, per CPU second (then
    ``ceiling_gflops`` must be the per-CPU-second ceiling)."""
    rows = list(rows)
    per: dict[str, list[dict]] = {name: [] for name in rows}
    for r in range(rounds):
        order = rows[r % len(rows):] + rows[:r % len(rows)]
        for name in order:
            first = per[name][0] if per[name] else None
            if r > 0 and first and min(first["wall_s"], first["cpu_s"]) >= slow_s:
                continue
            m = runner(measure_row, case, name, reps, memory and r == 0, slow_s)
            per[name].append(m)
            if rounds > 1:
                log(f"  {case.name:>14} {name:>14} round {r + 1}/{rounds}: cpu "
                    f"{1e3 * m['cpu_s']:9.1f} ms  wall {1e3 * m['wall_s']:9.1f} ms  others busy "
                    f"{m['others_busy_cores']} cores")
    out = []
    dense = per.get("dense")
    for name in rows:
        ms = per[name]
        first = ms[0]
        wall_r, cpu_r = [m["wall_s"] for m in ms], [m["cpu_s"] for m in ms]
        wall_s, cpu_s = statistics.median(wall_r), statistics.median(cpu_r)
        row = {"case": case.name, **asdict(case), "row": name,
               **{k: v for k, v in first.items()
                  if k not in ("wall_s", "cpu_s", "others_busy_cores", "loadavg")},
               "wall_ms": 1e3 * wall_s, "cpu_ms": 1e3 * cpu_s, "rounds": len(ms),
               "wall_ms_rounds": [round(1e3 * v, 6) for v in wall_r],
               "cpu_ms_rounds": [round(1e3 * v, 6) for v in cpu_r],
               "wall_ms_samples": [v for m in ms for v in m["wall_ms_samples"]],
               "cpu_spread": spread([1e3 * v for v in cpu_r]),
               "others_busy_cores": [m["others_busy_cores"] for m in ms],
               "loadavg": [m["loadavg"] for m in ms]}
        row["cpu_rel_spread"] = row["cpu_spread"]["rel_halfrange"]
        pairs = first["pairs"] if "pairs" in first else case.T * case.k * case.G
        flops = _flops_fwd_bwd(case, pairs, dense_width(case, name))
        row["gflops"] = flops / wall_s / 1e9
        row["gflops_per_cpu_s"] = flops / cpu_s / 1e9
        rate = row["gflops_per_cpu_s"] if use_cpu else row["gflops"]
        row["mfu"] = rate / ceiling_gflops if ceiling_gflops else None
        row["vs_dense"] = row["vs_dense_cpu"] = None
        if dense:
            vw = _paired(wall_r, [m["wall_s"] for m in dense])
            vc = _paired(cpu_r, [m["cpu_s"] for m in dense])
            row["vs_dense"], row["vs_dense_cpu"] = statistics.median(vw), statistics.median(vc)
            row["vs_dense_cpu_spread"] = spread(vc)
            row["vs_dense_wall_spread"] = spread(vw)
        out.append(row)
        sp = row["cpu_spread"]["rel_halfrange"]
        log(f"  {case.name:>14} {name:>14}: {row['wall_ms']:9.1f} ms  x{row['vs_dense'] or 0:5.2f} dense"
            f"  | cpu {row['cpu_ms']:9.1f} ms  x{row['vs_dense_cpu'] or 0:5.2f}"
            + (f" (+-{100 * sp:.0f}% over {len(ms)} rounds)" if len(ms) > 1 and sp is not None else "")
            + (f"  peak {row['peak_mem_mb']:8.1f} MB" if row.get("peak_mem_mb") is not None else ""))
    return out


def layer_targets(rows: list[dict], metric: str = "wall_ms") -> list[dict]:
    """The issue's layer targets on one run's rows with ``metric`` (wall_ms | cpu_ms). A ratio
    is the median of per-round ratios (rows measured in the same round), with their min/max."""
    by = {(r["E"], r["G"], r["k"], r["row"]): r for r in rows}
    t = []

    def ratio(a, b):
        ra, rb = by.get(a), by.get(b)
        if not (ra and rb):
            return None, None
        key = f"{metric}_rounds"
        vals = _paired(ra.get(key) or [ra[metric]], rb.get(key) or [rb[metric]])
        return statistics.median(vals), [round(min(vals), 3), round(max(vals), 3)]

    def add(name, a, b, limit, ok, invert=False):
        v, rng = ratio(b, a) if invert else ratio(a, b)
        t.append({"target": name, "value": None if v is None else round(v, 3), "limit": limit,
                  "range": rng, "met": bool(ok(v)) if v is not None else None})

    add("relu / dense at E=8 G=1 k=1", (8, 1, 1, "relu"), (8, 1, 1, "dense"), "<= 1.15",
        lambda v: v <= 1.15)
    for (E, G) in sorted({(r["E"], r["G"]) for r in rows}):
        c = (E, G, 1)
        if (E, G) == (128, 1):
            add(f"relu / dense at E={E} G={G}", (*c, "relu"), (*c, "dense"), "<= 1.6",
                lambda v: v <= 1.6)
        if (E, G) == (8, 64):
            add(f"relu / dense at E={E} G={G}", (*c, "relu"), (*c, "dense"), "<= 2.0",
                lambda v: v <= 2.0)
        add(f"relu / topk at E={E} G={G}", (*c, "relu"), (*c, "topk"), "<= 1.05",
            lambda v: v <= 1.05)
        add(f"relu (fused) / relu_unfused at E={E} G={G}", (*c, "relu"), (*c, "relu_unfused"),
            "<= 1.0", lambda v: v <= 1.0)
        add(f"relu_stage1 / dense_wide at E={E} G={G}", (*c, "relu_stage1"), (*c, "dense_wide"),
            "<= 1.3", lambda v: v <= 1.3)
        add(f"hf_eager / relu at E={E} G={G}", (*c, "hf_eager"), (*c, "relu"), "> 1.0",
            lambda v: v > 1.0)
        need = 1.2 if (E, G) in ((128, 1), (8, 64)) else None
        add(f"hf_grouped_mm / relu at E={E} G={G}", (*c, "hf_grouped_mm"), (*c, "relu"),
            f">= {need}" if need else "> 1.0", lambda v: v >= need if need else v > 1.0)
    return [x for x in t if x["value"] is not None]  # rows this run did not measure: no target
