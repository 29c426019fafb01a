"""What a run trains with, in the order the trainer sets it up.

:func:`setup_runtime`: CPU threads, torch.distributed, the device and the precision;
:func:`prepare_run_data`: the run's data; :func:`start_model`: the model, fresh or from existing
weights (:mod:`remoe.train.init_from`); :func:`lay_out`: the model over the processes, expert
parallelism (each rank keeps a slice of every MoE layer's experts,
:mod:`remoe.distributed.expert_parallel`), the dispatch plan, ``train.compile``
(:func:`compile_blocks`) and FSDP2 (:mod:`remoe.distributed.fsdp`); :func:`wrap_data_parallel`:
the DDP wrapper of plain data parallelism; and Ctrl-C or SIGTERM during training
(:class:`StopOnInterrupt`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from remoe import rundir
from remoe.distributed.fsdp import shard_model
from remoe.distributed.setup import DistInfo, init_distributed, resolve_device
from remoe.errors import ConfigError
from remoe.experiment import padded_vocab
from remoe.machine.kernels import separate_compile_cache
from remoe.machine.threads import ThreadTuner, fix_threads, usable_cores
from remoe.model import ReMoEForCausalLM, registry


@dataclass
class Runtime:
    threads: ThreadTuner | None  # the timing tuner (train.num_threads=auto only)
    num_threads: int | None  # the fixed count (None: auto); a resume may replace it (recorded)
    dist: DistInfo
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: fp32
    dispatch_plan: str  # train.dispatch_plan resolved: exact, static or capacity


def setup_runtime(tc) -> Runtime:
    """Threads, process group and device of ``tc`` (the ``train`` section)."""
    # null: all usable cores, N: N (remoe.machine.threads; the trainer reuses a resumed run's
    # recorded count and prints the load hint once it knows the count); auto: timed
    threads, fixed = None, None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if tc.num_threads == "auto":
        threads = ThreadTuner(usable_cores(local), probe_every=tc.thread_probe_every)
    else:
        fixed = fix_threads("remoe train", tc.num_threads, local, hint=False)
    want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
    info = init_distributed("cuda" if want_cuda else "cpu")
    device = resolve_device(tc.device, info)
    precision = tc.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return Runtime(threads, fixed, info, device,
                   torch.bfloat16 if precision == "bf16" else None,
                   resolve_dispatch_plan(tc, device, info.world_size))


def resolve_dispatch_plan(tc, device: torch.device, world_size: int = 1) -> str:
    """``train.dispatch_plan`` for this device: ``auto`` is ``capacity`` where a GPU
    measurement showed it faster with the same results (one process on CUDA, each block
    compiled: 1.22x the exact plan's tokens/s for ReLU on an H200, docs/GPU.md), else
    ``exact`` (the CPU path: bit for bit what it was; several processes, expert parallelism
    and FSDP: not measured with it, ``capacity`` explicitly to try it)."""
    if tc.dispatch_plan != "auto":
        return tc.dispatch_plan
    measured = device.type == "cuda" and tc.compile and world_size == 1
    return "capacity" if measured and not (tc.expert_parallel or tc.fsdp) else "exact"


def settle_threads(rt: Runtime, tc, state: dict | None, is_main: bool) -> None:
    """The run's thread count, fixed in ``rt.num_threads``: a resume under
    ``train.num_threads: null`` reuses the count the run recorded (its checkpoint's, else its
    last metrics line's), so the resumed steps compute what the uninterrupted run would have;
    then the load hint (rank 0, on CPU: on a GPU the host threads do not set the speed).
    Nothing to do under ``train.num_threads=auto`` (timed)."""
    if rt.threads is not None:
        return
    recorded = None
    if state is not None and tc.num_threads is None:
        recorded = state.get("num_threads") or (state.get("last_record") or {}).get("threads")
    want = recorded if isinstance(recorded, int) and recorded >= 1 else rt.num_threads
    if recorded is not None and recorded != rt.num_threads and is_main:
        rundir.say(f"--resume: {want} threads, as the run recorded (this process would "
                   f"use {rt.num_threads})")
    rt.num_threads = fix_threads("remoe train", want, hint=is_main and rt.device.type == "cpu",
                                 fix="--set train.num_threads=1 (or OMP_NUM_THREADS=1)")


def prepare_run_data(data_cfg, is_main: bool, progress: bool, barrier):
    """The run's data: rank 0 builds (or opens) the cache, then the other ranks open it."""
    from remoe.data import prepare_data

    data = prepare_data(data_cfg, progress=progress) if is_main else None
    barrier()
    data = data if is_main else prepare_data(data_cfg, progress=False)
    # the model's vocabulary is >= the tokenizer's (checked where the model is made): a store
    # with a larger id (a pre-tokenised source of another tokenizer) stops here, not mid-step
    data.check_vocabulary(data.vocab_size, "the tokenizer's vocabulary")
    return data


def start_model(cfg, data, sampler, device: torch.device, info: DistInfo, resume: bool):
    """``(model on device, InitModel or None, lr_start or None)``: a fresh model of ``cfg``'s
    model section, or ``train.init_from``'s (:mod:`remoe.train.init_from`: the source's model
    with the config's overrides and its first lambda; ``lr_start``: train.init_lr resolved);
    on ``--resume`` of such a run, the run's recorded model config (the weights then come from
    the run's checkpoint)."""
    torch.manual_seed(cfg.run.seed)
    if cfg.train.init_from is None:
        model_cfg = cfg.model_config(vocab_size=padded_vocab(data.vocab_size),
                                     eos_token_id=data.eos_id, bos_token_id=data.eos_id,
                                     pad_token_id=data.eos_id)
        if model_cfg.backbone.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size={model_cfg.backbone.vocab_size} must "
                              f"be >= the tokenizer's vocabulary ({data.vocab_size})")
        return ReMoEForCausalLM(model_cfg).to(device), None, None
    from remoe.train import init_from, init_lambda

    if resume:
        model = init_from.from_record(cfg.run_dir)
        if model is not None:
            return model.to(device), None, init_from.recorded_lr(cfg.run_dir)
    init = init_from.build(cfg)
    init_from.start_lr(init, cfg.train)  # train.init_lr (ConfigError: no log)
    init_from.check_vocabulary(init.source, data, init.model.config)
    model = init.model.to(device)
    if model.config.uses_adaptive_reg:
        input_ids, _ = sampler.batch(0, 0, info.rank)
        init_lambda.choose_lambda(init, cfg.train.init_lambda, input_ids.to(device), info.enabled)
    return model, init, init.lr_start


# ----------------------------------------------------------------------------- layout

def lay_out(model: torch.nn.Module, tc, model_cfg, rt: Runtime):
    """``(ep, fsdp)``, each None when off: ``model`` laid out in place, this rank's slice of the
    experts (``train.expert_parallel``), the dispatch plan (``train.dispatch_plan``), each
    decoder block compiled (``train.compile``, before FSDP), the LM head + loss compiled
    (``train.compile_loss``), FSDP2 over the blocks and the root (``train.fsdp``)."""
    ep = setup_expert_parallel(model, tc, model_cfg, rt.dist)
    set_dispatch_plan(model, rt.dispatch_plan)
    if tc.compile:
        compile_blocks(model)
    if tc.compile_loss:
        separate_compile_cache()
        model.compile_lm_loss()
    fsdp = (shard_model(model, rt.device, ep, rt.autocast_dtype is not None) if tc.fsdp
            else None)
    return ep, fsdp


def setup_expert_parallel(model: torch.nn.Module, tc, model_cfg, info):
    """Replace every MoE layer's experts by this rank's slice (None: off or one process)."""
    if not tc.expert_parallel:
        return None
    from remoe.distributed.expert_parallel import shard_experts
    from remoe.experiment import check_expert_parallel

    check_expert_parallel(model_cfg.routing.router, model_cfg.routing.num_routed,
                          info.world_size)
    if not info.enabled:
        return None
    # a group of its own: the expert exchanges never interleave with DDP's all-reduces
    return shard_experts(model, dist.new_group())


def wrap_data_parallel(model: torch.nn.Module, info, device: torch.device, ep, fsdp, router: str):
    """DDP around ``model`` under torchrun without FSDP (the model itself otherwise); the experts
    of an expert-parallel model are left to their own all-to-all and gradient averaging."""
    if not info.enabled or fsdp is not None:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ep is not None:  # each rank owns different experts: DDP must not touch them
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ep.params))
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=not registry.declares(router, "uses_all_params"))


# ----------------------------------------------------------------------------- compile

def compile_blocks(model: torch.nn.Module, **options) -> int:
    """``train.compile=true``: every block of ``model.layers`` compiled on its own, in place
    (``torch.compile`` ``options``, e.g. ``backend=``); the number of blocks compiled.

    As torchtitan does for its transformer blocks: the blocks share one code object, so dynamo
    traces a block once and every block of the model runs the same compiled graphs (the
    parameters are graph inputs); the embedding, the final norm, the LM head and the loss stay
    eager. Applied after expert parallelism and before FSDP. ``nn.Module.compile`` compiles in
    place, so the parameter names, the state dict and the checkpoints are those of the eager
    model.

    Shapes: a block's tensors are sized by the tokens of a micro-batch (fixed in training) and,
    for data-dependent routing (ReLU), by the dispatch plan (``train.dispatch_plan``). On the
    default exact plan the pair count comes from a ``nonzero``: dynamo breaks the block's graph
    there and compiles the pieces around it once, with the pair count symbolic, so a change of
    routing does not recompile (tests/train/test_compile.py). On the static plan the plan is
    padded to ``T*N`` rows (:func:`remoe.model.dispatch.plan`): one graph per block, no break,
    no sync -- but slower on an H200 (docs/SCALING.md). What does recompile: a new micro-batch
    shape (evaluation batches; automatic dynamic shapes then make that dimension symbolic), and
    grad mode on / off. The fused CPU backend (a custom kernel walking a host-side plan) is not
    traceable; dynamo runs it eagerly between graphs, so on CPU
    ``model.expert_backend=grouped_mm`` is the compileable path.
    """
    blocks = list(getattr(model, "layers", ()))
    separate_compile_cache()  # inductor's disk cache, one per CPU kernel path
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def set_dispatch_plan(model: torch.nn.Module, plan: str) -> int:
    """``train.dispatch_plan``: ``static`` pads every MoE layer's data-dependent dispatch plan to
    a static capacity (no host sync), ``exact`` plans the active pairs only (``nonzero``), and
    ``capacity`` leaves the layers exact: the trainer passes each forward its capacities
    (:class:`CapacityPlan`); the number of MoE layers set."""
    from remoe.model.moe import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.static_plan = plan == "static"
    return len(layers)

def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide counters: frames compiled (``frames``: one per compiled graph
    entry, recompilations included) and graph breaks (``graph_breaks``)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph breaks so far, by reason (its message's text): how many of each."""
    from torch._dynamo.utils import counters

    return {str(k): int(v) for k, v in counters["graph_break"].items()}


# ----------------------------------------------------------------------------- interrupt
# Ctrl-C or a SIGTERM during training keeps the work: the first SIGINT or SIGTERM finishes the
# current step and the trainer writes a checkpoint and stops (:class:`TrainingInterrupted`, exit
# status 130 for SIGINT, 143 for SIGTERM -- what a job scheduler's pre-emption sends -- with the
# command that resumes); a second signal stops at once (``KeyboardInterrupt`` for SIGINT, the
# default termination for SIGTERM).
#
# Only in a single process: under torchrun every rank would have to agree on the step to stop
# at, so there a SIGINT stops at once and the run resumes from its last periodic checkpoint.

class TrainingInterrupted(Exception):
    """The run stopped on a SIGINT or SIGTERM (``signum``) after ``step``, checkpointed in
    ``checkpoint``; :attr:`exit_status` is 128 + the signal's number (130, 143)."""

    def __init__(self, step: int, checkpoint: Path | None,
                 signum: int = signal.SIGINT) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.checkpoint, self.signum = step, checkpoint, int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnInterrupt:
    """Context manager: while active, the first SIGINT or SIGTERM sets :attr:`requested` and
    :attr:`signum` (and puts the previous handlers back, so a second signal acts as it did
    before). A signal is left alone outside the main thread, when disabled, or when it is
    ignored (``nohup`` ignores SIGINT)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self.signum: int | None = None
        self._prev: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.requested, self.signum = True, signum
        self._restore()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
        print(f"\nremoe train: {what}: finishing this step, then a checkpoint ({again} to stop "
              "at once, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for sig, prev in self._prev.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, prev)
        self._prev = {}

    def __enter__(self) -> "StopOnInterrupt":
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                prev = signal.getsignal(sig)
                if prev is not signal.SIG_IGN and prev is not None:
                    self._prev[sig] = prev
                    signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
