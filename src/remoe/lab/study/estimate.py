"""Cost estimates of study runs for ``remoe study --dry-run``: FLOPs, then CPU time.

FLOPs come from :class:`remoe.train.metrics.FlopCounter` (the trainer's own count) with a model
of how many experts a token uses:

* TopK, SparseMixer, Hash: k*G per layer; TopK warm-up: ``warmup_k*G`` for ``warmup_steps``
  steps; Expert-Choice: k*G*capacity_factor; Lory: its merged expert (``effective_pairs``);
  dense / dense x E: no routed pairs (their FFN is in the fixed cost).
* ReLU: a ReLU gate of a zero-mean logit is open half of the time, so stage I runs about N/2
  experts per token and layer (N = E*G); we count ``N/2`` for the first
  ``n_I = ln(RELU_LAMBDA_REF / lambda0) / ln(alpha)`` steps and k*G after. RELU_LAMBDA_REF is
  fitted to a measured run (hidden 128, 4 layers, E=32, lambda0=1e-8, alpha=1.2, 600
  steps of 4096 tokens spent 4.97e13 FLOPs against TopK's 3.42e13: the 1.56e13 extra FLOPs
  are 54 steps at N/2 experts, i.e. lambda0 * alpha^54 = 1.9e-4).

A run that finished is not estimated: its FLOPs are read from its ``summary.json``. Periodic
validation and mask recording are added as forward passes (1/3 of a training FLOP per token).

CPU time = FLOPs / (probe x :data:`EFFICIENCY`), where the probe is the machine's fp32 GEMM
rate per CPU second on one thread (:func:`remoe.machine.perf.matmul_ceiling`, a 512^3 ``mm``:
~0.1 s) and EFFICIENCY the share of it a whole training step reaches at the study's sizes
(attention, softmax, dispatch, optimizer, evaluation, checkpoints, Python), plus a fixed
:data:`RUN_OVERHEAD_CPU_S` per run.

Once runs of the study have finished, :func:`achieved_rate` measures the rate they actually
reached: training FLOPs per thread-second of training wall time (``summary.json``'s ``flops``
and ``elapsed_s``, the sum of step times over every attempt, times the run's threads). That
rate includes the study's real step costs and whatever load the machine carried while they ran,
so ``--dry-run`` also prints the time left at that rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from remoe.model import registry

#: lambda at which a ReLU run's stage I (about N/2 experts per token) is taken to end; see above.
RELU_LAMBDA_REF = 1.9e-4
#: Achieved training FLOP/s per CPU second / the one-thread GEMM probe. Calibrated against a
#: real short run of the study backbone on this 2-core machine (hidden 128, 4 layers, FFN 512,
#: vocab 8192, seq 256 x 16, one thread, TopK E=8 k=1, no periodic eval; machine shared, load
#: average 4-8): 40 steps took 95.9 CPU-s and 1 step 22.4 CPU-s (start-up, data, final
#: evaluation and save), so 39 steps = 2.21e12 FLOPs in 73.5 CPU-s = 30 GFLOP/CPU-s, against a
#: probe of 42-63 (median ~50) GFLOP/CPU-s: 0.6. It is one number for every router:
#: many-expert runs spend more of their time in dispatch, so their estimates err low.
EFFICIENCY = 0.6
#: CPU seconds of a run beyond its FLOPs: interpreter and library start-up, data loading, the
#: final evaluation and save (the 1-step run above).
RUN_OVERHEAD_CPU_S = 20.0

@dataclass
class RunCost:
    steps: int
    tokens: int
    flops: float  # training FLOPs
    extra_flops: float  # validation and mask-recording forwards
    measured: bool = False  # True: read from the finished run


def _model_cfg(exp) -> Any:
    from remoe.experiment import padded_vocab

    return exp.model_config(vocab_size=padded_vocab(exp.data.vocab_size))


def tokens_per_step(config: dict[str, dict[str, Any]]) -> int:
    """Tokens one optimizer step draws under a run's sections dict."""
    from remoe.experiment import TrainConfig

    t = {**TrainConfig().__dict__, **config.get("train", {})}
    # the sampler draws seq_len + 1 tokens per sequence (inputs and shifted targets)
    return (int(t["seq_len"]) + 1) * int(t["micro_batch_size"]) * int(t["grad_accum"])


def pairs_per_token(mc, step: int | None = None, steps_dense: int = 0) -> float:
    """Active (token, expert) pairs per token summed over layers, as the trainer would count
    them at ``step`` (None: after every warm-up / stage I): the router's ``expected_pairs``."""
    if not mc.is_moe:
        return 0.0
    from remoe.model.routers.base import Router

    r = mc.routing  # FFN kinds (Lory) have no expected_pairs of their own: the router default
    expected = getattr(registry.resolve(r.router), "expected_pairs", Router.expected_pairs)
    return float(mc.backbone.num_layers * expected(r, step, steps_dense))


def relu_dense_steps(mc) -> int:
    """Estimated steps of stage I for a router under the adaptive lambda: lambda climbs from
    lambda0 to :data:`RELU_LAMBDA_REF` by alpha per step (0 for every other router)."""
    if not registry.declares(mc.routing.router, "uses_adaptive_reg"):
        return 0
    c = mc.control
    return max(0, math.ceil(math.log(RELU_LAMBDA_REF / c.lambda0) / math.log(c.alpha)))


def _step_flops(mc, counter, tokens: int, pairs_per_tok: float) -> float:
    return counter.train_flops(tokens, counter.effective_pairs(pairs_per_tok * tokens, tokens))


def nominal_step_flops(config: dict[str, dict[str, Any]]) -> float:
    """Training FLOPs of one step at the run's sparse cost (k*G experts; no stage I)."""
    from remoe.experiment import load_config as load_run_config
    from remoe.train.metrics import FlopCounter

    exp = load_run_config(config)
    mc = _model_cfg(exp)
    counter = FlopCounter(mc.spec, exp.train.seq_len)
    return _step_flops(mc, counter, tokens_per_step(config), pairs_per_token(mc))


def estimate_flops(config: dict[str, dict[str, Any]]) -> RunCost:
    """Steps, tokens and FLOPs of a run from its config (its stop rule already applied)."""
    from remoe.experiment import load_config as load_run_config
    from remoe.train.metrics import FlopCounter

    exp = load_run_config(config)
    tc, ac = exp.train, exp.analysis
    mc = _model_cfg(exp)
    counter = FlopCounter(mc.spec, tc.seq_len)
    tps = (tc.seq_len + 1) * tc.micro_batch_size * tc.grad_accum  # as the sampler draws
    dense = relu_dense_steps(mc)
    flops, step, tokens = 0.0, 0, 0
    while step < tc.max_steps:  # the trainer's stop rules, step by step
        if tc.max_tokens is not None and tokens >= tc.max_tokens:
            break
        if tc.max_flops is not None and flops >= tc.max_flops:
            break
        flops += _step_flops(mc, counter, tps, pairs_per_token(mc, step, dense))
        step += 1
        tokens += tps
    fwd_per_token = _step_flops(mc, counter, 1, pairs_per_token(mc)) / 3.0
    n_eval = (step // tc.eval_every if tc.eval_every else 0) + 1
    eval_tokens = tc.eval_chunks_per_domain * 5 * tc.seq_len  # five built-in domains
    n_masks = (step // ac.record_masks_every + 1) if ac.record_masks_every and mc.is_moe else 0
    extra = fwd_per_token * (n_eval * eval_tokens + n_masks * ac.calib_tokens)
    return RunCost(step, tokens, flops, extra)


def probe_gflops() -> float:
    """fp32 GEMM GFLOP per CPU second on one thread (a quick 512^3 probe)."""
    import torch

    from remoe.machine.perf import matmul_ceiling

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return float(matmul_ceiling(quick=True)["matmul_fp32_gflops_per_cpu_s"])
    finally:
        torch.set_num_threads(before)


def cpu_seconds(cost: RunCost, gflops: float, efficiency: float = EFFICIENCY) -> float:
    return (cost.flops + cost.extra_flops) / (gflops * 1e9 * efficiency) + RUN_OVERHEAD_CPU_S


def achieved_rate(finished: list[tuple[float, float, int]]) -> float | None:
    """GFLOP per thread-second of training wall time over finished runs, each given as
    ``(training FLOPs, elapsed_s, threads)``; None when none has a positive time."""
    flops = sum(f for f, t, n in finished if t > 0 and n > 0)
    thread_s = sum(t * n for f, t, n in finished if t > 0 and n > 0)
    return flops / thread_s / 1e9 if thread_s > 0 and flops > 0 else None


def thread_seconds(cost: RunCost, rate_gflops: float) -> float:
    """Thread-seconds of wall time a run needs at an :func:`achieved_rate` (plus the per-run
    overhead, which the training time of a finished run does not contain)."""
    return (cost.flops + cost.extra_flops) / (rate_gflops * 1e9) + RUN_OVERHEAD_CPU_S
