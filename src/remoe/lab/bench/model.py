"""Model suite: training / inference throughput of the ``tiny`` preset, stages I-II, and memory.

* **Throughput** (rows ``dense``, ``topk``, ``relu``): tokens/s of a training step (forward,
  backward, grad clipping, AdamW step) and of an inference forward, measured interleaved (one
  step of each model per round). ``relu`` is forced into its sparse stage III: each MoE layer's
  router gets a calibrated per-expert bias (layer by layer, on the benchmark batch) so that
  exactly ``k/E`` of the tokens activate every expert (:func:`remoe.lab.bench.layer.force_relu_density`);
  the sparsity actually seen during the timed steps is reported.
* **Stages I-II**: a real short ReMoE run from initialisation (AdamW, the paper's
  LambdaController with lambda0=1e-8, alpha=1.2) on a synthetic Markov-chain corpus, next to a
  TopK run stepped alternately. Steps before the sparsity first reaches ``1 - k/E - 0.02`` are
  stages I-II; their extra time is their summed step time minus as many steady-state steps.
* **Memory**: peak tensor memory of one training forward+backward with the ReLU model forced
  fully dense (stage I: every expert active) vs forced sparse, with and without
  ``recompute_experts``.
"""

from __future__ import annotations

import statistics
import time

import torch

from remoe.lab.bench.common import peak_tensor_memory, time_interleaved
from remoe.lab.bench.layer import force_relu_density
from remoe.model.config import ReMoEConfig
from remoe.model.llama import ReMoEForCausalLM
from remoe.model.moe import MoELayer
from remoe.method.sparsity import step_statistics, total_loss
from remoe.method.sparsity import build_controller
from remoe.train.optim import clip_gradients

ROWS = ("dense", "topk", "relu")


def markov_batches(vocab: int, batch: int, seq: int, seed: int = 0, branching: int = 4):
    """An endless stream of ``[batch, seq]`` token batches from a fixed sparse Markov chain."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=g)
    while True:
        tok = torch.randint(0, vocab, (batch,), generator=g)
        rows = [tok]
        for _ in range(seq - 1):
            pick = torch.randint(0, branching, (batch,), generator=g)
            tok = succ[tok, pick]
            rows.append(tok)
        yield torch.stack(rows, 1)


def build_model(router: str, preset: str = "tiny", recompute: bool = False, seed: int = 0,
                **overrides) -> ReMoEForCausalLM:
    torch.manual_seed(seed)
    cfg = ReMoEConfig.from_preset(preset, router=router, recompute_experts=recompute, **overrides)
    return ReMoEForCausalLM(cfg)


def moe_layers(model: ReMoEForCausalLM) -> list[MoELayer]:
    return [b.ffn for b in model.layers if isinstance(b.ffn, MoELayer)]


def force_model_density(model: ReMoEForCausalLM, ids, density: float) -> None:
    """Calibrate every ReLU layer's bias, first layer first, on the inputs it sees with the biases
    of the earlier layers already in place. ``ids``: one batch, or a list of batches that are
    calibrated as one (their tokens together hold exactly ``density``)."""
    batches = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    for layer in moe_layers(model):
        seen: list[torch.Tensor] = []

        def grab(mod, args, seen=seen):
            seen.append(args[0].detach())  # returns None: the inputs are left alone

        hook = layer.router.register_forward_pre_hook(grab)
        with torch.no_grad():
            for b in batches:
                model(b)
        hook.remove()
        force_relu_density(layer, torch.cat(seen), density)


def _train_step(model, opt, ids, lam: float, step: int, layer_lams: list[float] | None = None):
    out = model(ids, labels=ids, train_step=step)
    loss = total_loss(out, lam, layer_lams)  # the trainer's objective and clipping
    loss.backward()
    clip_gradients(model, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def _sparsity(out) -> float:
    """S of one forward, as the trainer computes it
    (:func:`remoe.method.sparsity.step_statistics`)."""
    return step_statistics(out.aux.active_counts_LN, out.aux.num_tokens).sparsity


def throughput(rows=ROWS, batch: int = 8, seq: int = 256, reps: int = 8, preset: str = "tiny",
               log=print, **overrides) -> list[dict]:
    """Training and inference tokens/s of each row (interleaved)."""
    ids = next(markov_batches(ReMoEConfig.from_preset(preset).vocab_size, batch, seq, seed=1))
    models, opts, sparsity = {}, {}, {}
    for r in rows:
        m = build_model(r, preset, **overrides)  # a row: a router name
        if m.config.uses_adaptive_reg:  # data-dependent sparsity: forced to its stage-III target
            force_model_density(m, ids, m.config.routing.target_density)
        models[r] = m
        # lr=0: the full AdamW update is computed but leaves the weights (and so the forced
        # routing) unchanged across the timed steps
        opts[r] = torch.optim.AdamW(m.parameters(), lr=0.0, weight_decay=0.1)
        sparsity[r] = []
    step = {r: 0 for r in rows}

    def train(r):
        def f():
            step[r] += 1
            out = _train_step(models[r], opts[r], ids, 1e-8, step[r])
            if out.aux.num_moe_layers:
                sparsity[r].append(_sparsity(out))
        return f

    def infer(r):
        def f():
            with torch.no_grad():
                models[r](ids)
        return f

    tr = time_interleaved({r: train(r) for r in rows}, reps=reps, warmup=1)
    inf = time_interleaved({r: infer(r) for r in rows}, reps=reps, warmup=1)
    T = batch * seq
    out = []
    for r in rows:
        m = models[r]
        row = {"row": r, "tokens_per_step": T,
               "train_step_ms": 1e3 * tr[r].wall, "train_tokens_per_s": T / tr[r].wall,
               "train_cpu_ms": 1e3 * tr[r].cpu,
               "infer_ms": 1e3 * inf[r].wall, "infer_tokens_per_s": T / inf[r].wall,
               "infer_cpu_ms": 1e3 * inf[r].cpu,
               "params": m.num_parameters(), "active_params": m.num_parameters(active=True),
               "sparsity_mean": statistics.mean(sparsity[r]) if sparsity[r] else None,
               "train_ms_samples": [round(1e3 * s, 2) for s in tr[r].wall_s]}
        # 6 N_active T for training (fwd+bwd), 2 N_active T for inference, attention excluded
        row["train_gflops"] = 6 * row["active_params"] * T / tr[r].wall / 1e9
        row["infer_gflops"] = 2 * row["active_params"] * T / inf[r].wall / 1e9
        out.append(row)
        log(f"  model {r:>6}: train {row['train_tokens_per_s']:8.0f} tok/s "
            f"({row['train_step_ms']:7.1f} ms/step)"
            f"  infer {row['infer_tokens_per_s']:8.0f} tok/s"
            + (f"  sparsity {row['sparsity_mean']:.3f}" if row["sparsity_mean"] is not None else ""))
    base = next((o for o in out if o["row"] == "dense"), None)
    for o in out:  # throughput relative to dense (> 1: faster), by wall and by CPU time
        o["train_vs_dense"] = o["train_tokens_per_s"] / base["train_tokens_per_s"] if base else None
        o["infer_vs_dense"] = o["infer_tokens_per_s"] / base["infer_tokens_per_s"] if base else None
        o["train_vs_dense_cpu"] = base["train_cpu_ms"] / o["train_cpu_ms"] if base else None
        o["infer_vs_dense_cpu"] = base["infer_cpu_ms"] / o["infer_cpu_ms"] if base else None
    return out


def stages(max_steps: int = 150, settle_margin: float = 0.02, extra_after_settle: int = 20,
           batch: int = 8, seq: int = 256, lr: float = 2e-3, preset: str = "tiny", log=print,
           metric: str = "wall_ms", **overrides) -> dict:
    """Per-step time and sparsity of a real ReMoE run from init, alternating with a TopK run."""
    relu = build_model("relu", preset, **overrides)
    topk = build_model("topk", preset, **overrides)
    c = relu.config
    target = c.routing.target_sparsity
    ctl = build_controller(c, c.backbone.num_layers)  # the config's own sparsity control
    opt_r = torch.optim.AdamW(relu.parameters(), lr=lr, weight_decay=0.1)
    opt_t = torch.optim.AdamW(topk.parameters(), lr=lr, weight_decay=0.1)
    data = markov_batches(c.backbone.vocab_size, batch, seq, seed=2)
    steps = []
    settled_at = None
    for i in range(max_steps):
        ids = next(data)
        c0, t0 = time.process_time(), time.perf_counter()
        out = _train_step(relu, opt_r, ids, ctl.coeff, i, ctl.layer_coeffs)
        t1, c1 = time.perf_counter(), time.process_time()
        st = step_statistics(out.aux.active_counts_LN, out.aux.num_tokens)
        s, lam = st.sparsity, ctl.coeff
        ctl.update(s, st.layer_sparsity, out.aux.active_counts_LN, out.aux.num_tokens)
        c2, t2 = time.process_time(), time.perf_counter()
        _train_step(topk, opt_t, ids, 0.0, i)
        t3, c3 = time.perf_counter(), time.process_time()
        steps.append({"step": i + 1, "relu_ms": 1e3 * (t1 - t0), "topk_ms": 1e3 * (t3 - t2),
                      "relu_cpu_ms": 1e3 * (c1 - c0), "topk_cpu_ms": 1e3 * (c3 - c2),
                      "sparsity": s, "lambda": lam})
        if settled_at is None and s >= target - settle_margin:
            settled_at = i + 1
            log(f"  stages: sparsity {s:.3f} reached target {target:.3f} - {settle_margin} at step {i + 1}")
        if settled_at is not None and i + 1 >= settled_at + extra_after_settle:
            break
    n12 = (settled_at - 1) if settled_at else len(steps)
    early, late = steps[:n12], steps[n12:]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    k = "relu_cpu_ms" if metric == "cpu_ms" else "relu_ms"
    kt = "topk_cpu_ms" if metric == "cpu_ms" else "topk_ms"
    relu_late = med([s[k] for s in late])
    res = {
        "metric": metric, "target_sparsity": target, "steps_run": len(steps),
        "settled_at_step": settled_at, "stage12_steps": n12,
        "relu_stage12_ms_per_step": med([s[k] for s in early]),
        "relu_stage3_ms_per_step": relu_late,
        "topk_ms_per_step_stage12_window": med([s[kt] for s in early]),
        "topk_ms_per_step_stage3_window": med([s[kt] for s in late]),
        "relu_stage12_sparsity_mean": statistics.mean(s["sparsity"] for s in early) if early else None,
        "steps": steps,
    }
    if late and early:
        extra = sum(s[k] for s in early) - n12 * relu_late
        res["stage12_extra_s"] = extra / 1e3
        res["stage12_extra_vs_stage3_step"] = extra / relu_late  # in stage-III steps
    return res


def memory(batch: int = 8, seq: int = 256, preset: str = "tiny", **overrides) -> list[dict]:
    """Peak tensor memory of a training fwd+bwd: ReLU forced dense vs sparse, recompute off/on."""
    ids = next(markov_batches(ReMoEConfig.from_preset(preset).vocab_size, batch, seq, seed=3))
    out = []
    for recompute in (False, True):
        res = {"recompute_experts": recompute}
        for phase in ("dense", "sparse"):
            m = build_model("relu", preset, recompute=recompute, **overrides)
            density = 1.0 if phase == "dense" else m.config.routing.target_density
            force_model_density(m, ids, density)

            def step():
                out = m(ids, labels=ids, train_step=0)
                total_loss(out, 1e-8).backward()

            step()  # allocator warm-up; grads exist afterwards like in a real run
            m.zero_grad(set_to_none=True)
            res[f"{phase}_peak_mb"] = peak_tensor_memory(step) / 2**20
            m.zero_grad(set_to_none=True)
        res["dense_vs_sparse"] = res["dense_peak_mb"] / res["sparse_peak_mb"]
        out.append(res)
    return out


def model_targets(thr: list[dict], mem: list[dict], metric: str = "wall_ms",
                  preset: str = "tiny") -> list[dict]:
    """The model targets (stated for the ``tiny`` preset), named after the measured ``preset``."""
    t = []
    by = {r["row"]: r for r in thr}
    key = "train_cpu_ms" if metric == "cpu_ms" else "train_step_ms"
    if "relu" in by and "dense" in by:
        v = by["dense"][key] / by["relu"][key]
        t.append({"target": f"{preset} model training tokens/s: relu (sparse) / dense",
                  "value": round(v, 3),
                  "limit": ">= 0.9", "met": v >= 0.9})
    if "relu" in by and "topk" in by:
        v = by["topk"][key] / by["relu"][key]
        t.append({"target": f"{preset} model training tokens/s: relu / topk", "value": round(v, 3),
                  "limit": "0.95 .. 1.05", "met": 0.95 <= v <= 1.05})
    for m in mem:
        if m["recompute_experts"]:
            v = m["dense_vs_sparse"]
            t.append({"target": "peak memory, dense stage / sparse stage (recompute_experts=True)",
                      "value": round(v, 3), "limit": "<= 1.3", "met": v <= 1.3})
    return t


__all__ = ["throughput", "stages", "memory", "model_targets", "markov_batches"]
