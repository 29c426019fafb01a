"""``remoe bench --suite gpu``: one command that checks a CUDA machine.

On a machine with CUDA:

* **bf16 vs fp32** (micro model, dense / TopK / ReMoE): the loss of one batch under bf16
  autocast (experts on ``grouped_mm``) against the same weights in fp32 (experts on the
  ``reference`` loop: CUDA's grouped_mm is bf16 only), and the cosine similarity of the two
  gradients;
* **training step** (the paper's ``small`` preset by default, 182M dense backbone, E=8, k=1,
  sequence 1024, GPT-2 vocabulary size): the real :class:`remoe.train.trainer.Trainer` step of
  dense / TopK / ReMoE in bf16 with ``model.expert_backend=grouped_mm`` on synthetic token
  batches; ReMoE's routers are calibrated to the sparse stage III (exactly ``k/E`` of the
  tokens per expert, :func:`remoe.lab.bench.model.force_model_density`) so that its figure is the
  steady state, not the dense stage I of a fresh model. Reported: tokens/s (after warm-up
  steps, synchronised), MFU = the trainer's counted training FLOPs per second over the
  device's dense bf16 peak (:data:`PEAK_BF16_TFLOPS`, or ``--peak-tflops``) and over a
  measured bf16 matmul, peak memory (``torch.cuda.max_memory_allocated``), and host
  synchronisations per step (:class:`remoe.machine.syncs.SyncCounter` over one step, real CUDA);
* **FSDP + expert parallelism** on two processes when two GPUs are visible: a short
  ``remoe train`` of the micro model under ``torchrun`` (NCCL), its tokens/s.

Without CUDA it prints one line and returns 0. The suite's driver and its table:
:mod:`remoe.lab.bench.gpu_check`. Every part takes a ``device`` so that its logic (shapes,
dtypes, the on-device dispatch plan, the table) is exercised on CPU by
``tests/bench/test_bench_gpu.py``.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: dense (no structured sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data
#: sheets; matched against ``torch.cuda.get_device_name()``, longest key first
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0,
    "GH200": 989.0,
    "A100": 312.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10": 125.0,
}
ROUTERS = ("dense", "topk", "relu")
GPT2_VOCAB = 50257


def peak_bf16_tflops(name: str) -> float | None:
    """The data-sheet dense bf16 peak of a device name (whole words: "A10" is not "A10G"),
    or None when unknown."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return PEAK_BF16_TFLOPS[key]
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10,
                  dtype: torch.dtype = torch.bfloat16) -> float:
    """Best measured ``n^3`` matmul rate on ``device`` (TFLOP/s)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def loss_check(device: torch.device, routers=ROUTERS, preset: str = "micro", batch: int = 4,
               seq: int = 64, rtol: float = 2e-2, min_cosine: float = 0.99) -> list[dict]:
    """bf16 autocast vs fp32 loss and gradient of the same weights on one batch."""
    from remoe.model.config import ReMoEConfig
    from remoe.model import ReMoEForCausalLM

    rows = []
    for router in routers:
        torch.manual_seed(0)
        model = ReMoEForCausalLM(ReMoEConfig.from_preset(preset, router=router)).to(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        res = {"router": router, "preset": preset}
        grads = {}
        for prec in ("fp32", "bf16"):
            model.zero_grad(set_to_none=True)
            dtypes = set()
            hooks = [b.ffn.register_forward_pre_hook(  # the MoE layer's input (fp32 stream)
                lambda mod, args: dtypes.add(str(args[0].dtype).replace("torch.", "")))
                for b in model.layers if hasattr(b.ffn, "experts")]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=prec == "bf16"):
                out = model(ids, labels=ids)
            out.loss.backward()
            for h in hooks:
                h.remove()
            res[f"loss_{prec}"] = float(out.loss.detach())
            res[f"expert_input_dtype_{prec}"] = sorted(dtypes)
            grads[prec] = torch.cat([p.grad.double().flatten() for p in model.parameters()
                                     if p.grad is not None])
        res["loss_rel_diff"] = abs(res["loss_bf16"] - res["loss_fp32"]) / abs(res["loss_fp32"])
        res["grad_cosine"] = float(torch.nn.functional.cosine_similarity(
            grads["fp32"], grads["bf16"], dim=0))
        res["ok"] = res["loss_rel_diff"] <= rtol and res["grad_cosine"] >= min_cosine
        rows.append(res)
    return rows


def train_row(router: str, device: torch.device, preset: str = "small", seq_len: int = 1024,
              micro_batch: int = 8, steps: int = 10, warmup: int = 3, precision: str = "bf16",
              vocab: int = GPT2_VOCAB, peak_tflops: float | None = None,
              matmul_peak: float | None = None, compile_backend: str | None = None,
              plan: str = "exact", grad_accum: int = 1, capture_dynamic: bool = False,
              adamw: str = "auto", loss_chunk: int = 0, profile: bool = False,
              step_options: tuple[str, ...] = ()) -> dict:
    """Tokens/s, MFU, peak memory and syncs per step of the real trainer step (see module doc).

    ``compile_backend``: each decoder block compiled with it (``inductor``: what
    ``train.compile=true`` does; the warm-up steps then include the compilation).
    ``plan``: ``train.dispatch_plan`` for data-dependent routing: ``exact`` (``nonzero``: one
    sync per MoE layer), ``static`` (padded to ``T*N``) or ``capacity`` (padded to the previous
    steps' pairs; :class:`remoe.train.control.CapacityPlan`); ``capture_dynamic``: dynamo
    captures the exact plan's ``nonzero`` in the graph instead of breaking there (the sync
    stays). ``grad_accum``: micro-batches per optimizer step; ``adamw``, ``loss_chunk``:
    ``train.adamw_impl``, ``train.loss_chunk_tokens``. ``step_options``: boolean ``train.*``
    options switched on (``prefetch``, ``cast_experts_once``). ``profile``: also one step's
    device time by kernel category (:func:`profile_step`).

    Equal work: every step reads the same ``grad_accum`` micro-batches, and ReLU's routers are
    calibrated on exactly those (:func:`remoe.lab.bench.model.force_model_density` over all of
    them), so each timed step holds ``k/E`` of the pairs, TopK's count; the row reports its
    pairs per token. The learning rate is tiny (``train.lr=1e-12``, ``train.min_lr=0``; the same
    work per step) so that the routers stay where the calibration put them."""
    from remoe.lab.bench.model import force_model_density
    from remoe.lab.bench.syncs import SyntheticData, close_trainer, step_config
    from remoe.model.moe import MoELayer
    from remoe.machine.syncs import SyncCounter
    from remoe.train.runtime import compile_blocks
    from remoe.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="remoe-gpu-") as tmp:
        cfg = step_config(router, preset, seq_len, micro_batch, grad_accum, tmp,
                          [f"train.device={device.type}", f"train.precision={precision}",
                           f"train.max_steps={warmup + steps + 10}", "train.lr=1e-12",
                           "train.min_lr=0", f"train.dispatch_plan={plan}",
                           f"train.adamw_impl={adamw}", f"train.loss_chunk_tokens={loss_chunk}",
                           *[f"train.{o}=true" for o in step_options]])
        t = Trainer(cfg, progress=False, data=SyntheticData(vocab, pool=grad_accum))
        try:
            layers = [b.ffn for b in t.model.layers if isinstance(b.ffn, MoELayer)]
            if t.model_cfg.uses_adaptive_reg:  # the sparse stage III on the very batches timed
                pool = [t.sampler.batch(0, m, 0)[0].to(t.device) for m in range(grad_accum)]
                with t._autocast():
                    force_model_density(t.model, pool, t.model_cfg.routing.target_density)
            t_compile = time.perf_counter()  # after the calibration (hooks would recompile)
            if compile_backend:
                compile_blocks(t.model, backend=compile_backend)
            with _dynamo_capture(capture_dynamic):
                for _ in range(warmup):
                    t.train_step()
                _sync(device)
                warmup_s = time.perf_counter() - t_compile
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                recs = []
                flops0 = t.total_flops  # the trainer's counted training FLOPs (cumulative)
                t0 = time.perf_counter()
                for _ in range(steps):
                    recs.append(t.train_step())
                _sync(device)
                dt = time.perf_counter() - t0
                flops = t.total_flops - flops0
                prof = profile_step(t, device) if profile else None
                with SyncCounter() as sc, sc.watch(t.model, "forward"):
                    sc.mark_host(*[st["step"] for st in t.optimizer.state.values()
                                   if isinstance(st.get("step"), torch.Tensor)])
                    t.train_step()
            peak_mem = (torch.cuda.max_memory_allocated(device) / 2**30
                        if device.type == "cuda" else None)
            expert_dtypes = _expert_dtypes(t, layers)
            redone = t.capacity.redone if t.capacity is not None else None
        finally:
            close_trainer(t)
    tokens = sum(r["step_tokens"] for r in recs)
    by = sc.by_phase()
    pairs = (sum(r["active_k"] for r in recs) / len(recs)) if layers else None
    row = {"router": router, "preset": preset, "device": device_info(device)["name"],
           "precision": precision, "backend": "grouped_mm", "compiled": compile_backend,
           "plan": plan, "capture_dynamic": capture_dynamic, "adamw": adamw,
           "loss_chunk": loss_chunk, "step_options": list(step_options), "warmup_s": warmup_s,
           "seq_len": seq_len,
           "micro_batch": micro_batch, "grad_accum": grad_accum,
           "step_tokens": recs[-1]["step_tokens"], "steps_timed": steps,
           "tokens_per_s": tokens / dt, "step_ms": 1e3 * dt / steps,
           "train_tflops": flops / dt / 1e12, "peak_mem_gib": peak_mem,
           "sparsity": sum(r["sparsity"] for r in recs) / len(recs) if layers else None,
           # (token, expert) pairs per token and MoE layer in the timed steps (k for TopK)
           "pairs_per_token": pairs, "steps_redone": redone,
           "loss_last": recs[-1]["loss"], "moe_layers": len(layers),
           "syncs_forward": by.get("forward", 0), "syncs_backward": by.get("backward", 0),
           "syncs_step": by.get("step", 0), "syncs_per_step": sc.count(),
           "syncs_report": sc.report().splitlines(), "expert_input_dtype": expert_dtypes,
           "profile": prof}
    row["mfu"] = row["train_tflops"] / peak_tflops if peak_tflops else None
    row["mfu_vs_matmul"] = row["train_tflops"] / matmul_peak if matmul_peak else None
    return row


def _dynamo_capture(on: bool):
    """``capture_dynamic_output_shape_ops``: dynamo keeps ``nonzero`` in the graph (no break)."""
    if not on:
        return contextlib.nullcontext()
    import torch._dynamo

    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


#: (category, name fragments), first match wins: CUDA kernel names (cuBLAS / CUTLASS / flash /
#: inductor's triton kernels) and, on CPU, aten operator names. Inductor names its fused
#: kernels after every op inside (``triton_red_fused__to_copy_add_mean_mul_...``): they come
#: before the copies and the index ops, or a fused RMSNorm with its dtype cast would count as
#: a copy (as it did in the H200 profile of 2026-11-28, results/gpu/NOTES.md)
KERNEL_CATEGORIES = (
    ("optimizer + clip", ("adam", "multi_tensor", "foreach", "optimizer.step", "clip_grad")),
    ("grouped GEMM", ("grouped", "group_gemm")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("LM loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("fused by inductor", ("triton_poi", "triton_red", "triton_per")),
    ("dense GEMM", ("gemm", "matmul", "xmma", "nvjet", "cutlass", "cublas", "triton_tem",
                    "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("gather / scatter / index", ("index", "gather", "scatter", "nonzero", "sort", "cumsum",
                                  "scan", "bincount", "radix", "unique", "histc")),
    ("copy / memset", ("memcpy", "memset", "copy")),
)


#: kernel names kept per category in a profile (``top_kernels``)
TOP_KERNELS = 6


def kernel_category(name: str) -> str:
    """The category of a kernel (or CPU operator) name; ``elementwise / other`` for the rest
    (inductor's fused pointwise and reduction kernels, activations, norms)."""
    low = name.lower()
    for cat, frags in KERNEL_CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "elementwise / other"


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds in) in ms."""
    busy, last = 0.0, None
    for a, b in sorted(intervals):
        if last is None or a > last:
            busy += b - a
            last = b
        elif b > last:
            busy += b - last
            last = b
    return busy / 1e3


def profile_step(t, device: torch.device) -> dict:
    """One trainer step under ``torch.profiler``: device time by :func:`kernel_category` (ms),
    the time some kernel ran (``busy_ms``) and the step's wall time; ``idle_ms`` = wall - busy
    (the device waiting for the host: launches, syncs, Python). On CPU the same from the
    operators' self time (the logic; the figures that matter are CUDA's). What the host
    launches itself in the step: ``host_ops`` operators outside every compiled graph (the
    eager glue: loss and statistics sums, casts, the optimizer's), the commonest by name, and
    ``compiled_calls`` calls into compiled graphs (forward; one per block and micro-batch
    without a graph break)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        t.train_step()
        _sync(device)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    per_name: dict[str, float] = {}  # ms per kernel (or operator) name
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        for e in kernels:
            ms = (e.time_range.end - e.time_range.start) / 1e3
            per_name[e.name] = per_name.get(e.name, 0.0) + ms
        busy = _busy_ms([(e.time_range.start, e.time_range.end) for e in kernels])
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                per_name[e.key] = per_name.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
        busy = sum(per_name.values())
    by: dict[str, float] = {}
    top: dict[str, list] = {}  # each category's heaviest names: what the next change targets
    for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1]):
        cat = kernel_category(name)
        by[cat] = by.get(cat, 0.0) + ms
        if len(top.setdefault(cat, [])) < TOP_KERNELS:
            top[cat].append([name[:160], round(ms, 3)])
    # what the host launches itself: operators outside every compiled graph (a compiled
    # graph's operators nest inside its region event) and the calls into compiled graphs
    outer = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    ops = collections.Counter(e.name for e in outer if e.name.startswith("aten::"))
    return {"wall_ms": wall_ms, "busy_ms": busy, "idle_ms": max(0.0, wall_ms - busy),
            "by_category_ms": dict(sorted(by.items(), key=lambda kv: -kv[1])),
            "top_kernels": top,
            "host_ops": sum(ops.values()), "host_ops_top": ops.most_common(TOP_KERNELS),
            "compiled_calls": sum(e.name.startswith("Torch-Compiled Region") for e in outer),
            "source": "cuda kernels" if cuda else "cpu operators (self time)"}


def head_loss(device: torch.device, hidden: int, vocab: int, tokens: int,
              chunk: int = 0, reps: int = 5, precision: str = "bf16",
              compiled: bool = False) -> dict:
    """The LM head + loss alone at a step's shape (``tokens`` positions of width ``hidden``):
    forward and backward time (best of ``reps``) and, on CUDA, the peak memory above its inputs;
    ``chunk`` > 0: :func:`remoe.model.losses.chunked_lm_loss`; ``compiled``: the whole batch's
    :func:`remoe.model.losses.lm_loss` under ``torch.compile`` (``train.compile_loss``). What
    the rest of the step pays for the logits, measured apart."""
    from remoe.model.losses import chunked_lm_loss, lm_loss

    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(1, tokens + 1, hidden, generator=g).to(device).requires_grad_(True)
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).to(device).requires_grad_(True)
    y = torch.randint(0, vocab, (1, tokens + 1), generator=g).to(device)
    ac = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    if compiled:
        from remoe.machine.kernels import separate_compile_cache

        separate_compile_cache()
    fn = torch.compile(lm_loss) if compiled else None

    def run():
        with ac:
            if chunk:
                loss = chunked_lm_loss(h, w, y, chunk)
            elif fn is not None:
                loss = fn(h, w, y)
            else:
                logits = torch.nn.functional.linear(h[:, :-1], w)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, vocab).float(), y[:, 1:].reshape(-1))
        loss.backward()
        h.grad = w.grad = None
        return loss

    run()
    _sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    peak = ((torch.cuda.max_memory_allocated(device) - base) / 2**30
            if device.type == "cuda" else None)
    return {"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk,
            "compiled": compiled, "ms": 1e3 * best, "peak_extra_gib": peak}


class _GroupedMMDtypes(TorchDispatchMode):
    """Records the input dtypes of every ``aten._grouped_mm`` call (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.seen.add(f"{args[0].dtype}x{args[1].dtype}".replace("torch.", ""))
        return func(*args, **(kwargs or {}))


def _expert_dtypes(t, layers) -> list[str]:
    """The dtypes ``grouped_mm`` computes in under the run's autocast (one forward+backward of
    one sequence; no optimizer step). Empty for a model without MoE layers."""
    if not layers:
        return []
    ids = t.sampler.batch(0, 0, 0)[0][:1].to(t.device)
    with _GroupedMMDtypes() as mode:
        with t._autocast():
            out = t.model(ids, labels=ids)
        out.loss.backward()
    t.model.zero_grad(set_to_none=True)
    return sorted(mode.seen)


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "capability": None, "memory_gib": None, "multiprocessors": None}
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib":
            round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}


def fsdp_ep_row(steps: int = 4) -> dict:
    """A 2-process FSDP + expert-parallel ``remoe train`` of the micro model (NCCL)."""
    from remoe.lab.bench.scale import run_layout

    with tempfile.TemporaryDirectory(prefix="remoe-gpu-fsdp-") as tmp:
        row = run_layout(2, "fsdp+ep", None, steps, Path(tmp),
                   ["model.preset=micro", "train.seq_len=256", "train.micro_batch_size=8",
                    "train.device=cuda"])
    return {"layout": "fsdp+ep", "world": 2, "tokens_per_s": row["tokens_per_s"],
            "step_tokens": row["step_tokens"], "steps": steps}
