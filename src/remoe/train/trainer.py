"""The training loop.

One optimizer step = ``grad_accum`` micro-batches on every data-parallel rank:

    LR schedule (optim.py); lambda(s) and the revival input from the controller
        (control.py: StepControl, the sequence ReMoETrainer runs too)
    for each micro-batch: out = model(x, labels=x, train_step=step[, revive=])
        loss = total_loss(out, lambda)   = L_lm + lambda_i * L_reg + L_aux   (remoe.method.sparsity)
        (loss / grad_accum).backward(); control.add(out): losses and routing counts
    expert-parallel grads, clip (optim.py); control.reduce: the step's one all-reduce
        (control.py: StepSums); stop on a non-finite loss, optimizer step (optim.py)
    control.after_step: step_statistics(counts) -> S_i, per-layer S, active k, dead experts
        (remoe.method.sparsity); routers' after_step; the controller's update (same lambda on
        every rank)
    FLOPs, metrics line and progress (metrics.py); periodic validation, mask recording
    (metrics.py) and atomic checkpoint (checkpoint.py)

Batches are a pure function of (seed, step, micro-step, rank), and RNG states, optimizer,
scheduler and controller are checkpointed, so ``resume`` continues bit-exactly on CPU.
The process, the data, the model and its layout over the ranks: runtime.py (with
remoe.distributed); starting or resuming in the run directory: resume.py; checkpoints and RNG
states: checkpoint.py.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from remoe import rundir
from remoe.data.sampler import device_batches
from remoe.distributed import dcp
from remoe.experiment import ExperimentConfig
from remoe.method.sparsity import penalty, total_loss
from remoe.model.experts import cast_once_per_step
from remoe.train import checkpoint as ckpt_io
from remoe.train.control import CapacityPlan, StepControl
from remoe.train.metrics import (FlopCounter, MetricsWriter, ProgressLines, calibration_set,
                                 open_progress, open_tensorboard, record_masks, run_summary,
                                 stats_text)
from remoe.train.optim import (build_optimizer, check_finite_losses, cosine_lr, finish_and_clip,
                               set_lr, stop_reason, update)
from remoe.train.resume import load_checkpoint, logged_eval, restore_last_record, start_run_dir
from remoe.train.runtime import (StopOnInterrupt, TrainingInterrupted, lay_out, prepare_run_data,
                                 settle_threads, setup_runtime, start_model, wrap_data_parallel)

# ----------------------------------------------------------------------------- the trainer

class Trainer:
    """Runs an :class:`ExperimentConfig`; ``train()`` returns the end-of-run summary dict."""

    def __init__(self, cfg: ExperimentConfig, resume: bool = False, progress: bool | None = None,
                 data=None) -> None:
        self.cfg = cfg
        self.resume = resume
        tc = cfg.train
        self.rt = rt = setup_runtime(tc)  # threads, process group, device, precision
        self.threads, self.dist, self.device = rt.threads, rt.dist, rt.device
        self.autocast_dtype = rt.autocast_dtype
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.dist.is_main
        self.run_dir = cfg.run_dir
        # config.yaml records where the data lives, usable from any working directory
        cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())

        # data (rank 0 builds the cache, the others then load it)
        if data is None:
            data = prepare_run_data(cfg.data, self.dist.is_main, self.progress, self._barrier)
        self.data = data
        self.sampler = data.train_batches(seq_len=tc.seq_len, micro_batch=tc.micro_batch_size,
                                          grad_accum=tc.grad_accum,
                                          world_size=self.dist.world_size, seed=cfg.run.seed)

        # model: fresh, or from existing weights (train.init_from: self.init says where from,
        # self.lr_start is train.init_lr resolved, None: the fresh schedule); then laid out over
        # the processes: expert parallel, dispatch plan, compile, FSDP (None when off)
        self.model, self.init, self.lr_start = start_model(cfg, data, self.sampler, self.device,
                                                           self.dist, resume)
        self.model_cfg = self.model.config
        self.ep, self.fsdp = lay_out(self.model, tc, self.model_cfg, rt)
        self.flops = FlopCounter(self.model_cfg.spec, tc.seq_len)
        # the step's routing side: the controller and the token router of every MoE layer, in
        # the order of the rows of the expert counts
        self.control = StepControl.for_model(self.model)
        self.controller, self.token_routers = self.control.controller, self.control.token_routers
        # train.dispatch_plan=capacity: each step's plan capacities (None: the layers' own plan)
        self.capacity = (CapacityPlan(len(self.token_routers))
                         if rt.dispatch_plan == "capacity" and self.token_routers else None)
        # train.prefetch on CUDA: the batches' copies run on their own stream
        # (remoe.data.sampler.device_batches)
        self.copy_stream = (torch.cuda.Stream(self.device)
                            if tc.prefetch and self.device.type == "cuda" else None)
        if self.init is not None and self.controller is not None and self.init.lambdas:
            self.controller.start(self.init.lambdas)  # a resume loads its own
        self.optimizer = self._build_optimizer()
        self.step = 0
        self.tokens = 0
        self.total_flops = 0.0
        self.elapsed = 0.0
        self.last_eval: dict[str, Any] | None = None
        self.lines: ProgressLines | None = None  # progress lines when there is no terminal

        self.ckpt_root = self.run_dir / "checkpoints"
        # lock, check and (resume) pick the checkpoint; the lock is released on any failure
        self.lock: rundir.RunLock | None = None
        self.lock, resume_from, state = start_run_dir(self.run_dir, cfg, resume,
                                                      self.dist.is_main, self._barrier,
                                                      self.model_cfg)
        try:
            settle_threads(rt, tc, state, self.dist.is_main)  # fixed for the run (None: auto)
            self.tokenizer_path = getattr(self.data, "tokenizer_path", None)
            if self.dist.is_main:  # the run's own tokenizer: a rebuilt cache cannot change it
                self.tokenizer_path = ckpt_io.keep_run_tokenizer(self.run_dir, self.data,
                                                                 resume_from is not None)
            self._saved_step = None  # the step of the newest checkpoint on disk
            if resume_from is not None:
                self._load(resume_from, state)
                self._saved_step = self.step
                self.last_eval = logged_eval(self.run_dir, self.step)  # not to be repeated
            self.wrapped = wrap_data_parallel(self.model, self.dist, self.device, self.ep,
                                              self.fsdp, self.model_cfg.routing.router)
            self.calib = (calibration_set(self.data, tc.seq_len, cfg.analysis.calib_tokens)
                          if cfg.analysis.record_masks_every > 0 and self.model_cfg.is_moe
                          else None)
            if self.dist.is_main:
                ckpt_io.atomic_write_text(self.run_dir / "config.yaml", cfg.to_yaml())
                if self.init is not None and resume_from is None:
                    self.init.write(self.run_dir, self.controller)
                rs = self.step if resume_from is not None else None
                self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", rs)
                if rs is not None:
                    restore_last_record(self.metrics, state, rs)
                self.evals = MetricsWriter(self.run_dir / "eval.jsonl", rs)
                self.tb = open_tensorboard(self.run_dir) if tc.tensorboard else None
        except BaseException:  # a refused or failed start releases the run directory
            self.close()
            raise

    # -- construction helpers ---------------------------------------------------------------
    def _barrier(self) -> None:
        if self.dist.enabled:
            dist.barrier()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg.train, self.device.type)

    def _full_experts(self):
        """Collective under EP: all experts gathered into self.model inside (save, counts)."""
        return self.ep.full_experts() if self.ep is not None else nullcontext()

    def _eval_batches(self):
        tc = self.cfg.train
        return self.data.eval_batches("validation", seq_len=tc.seq_len,
                                      batch_size=tc.eval_batch_size,
                                      max_chunks_per_domain=tc.eval_chunks_per_domain)

    # -- checkpoint state ---------------------------------------------------------------------
    def _state(self, optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "step": self.step, "tokens": self.tokens, "flops": self.total_flops,
            "elapsed": self.elapsed, "num_threads": self.rt.num_threads,
            "optimizer": (self.optimizer.state_dict() if optimizer_state is None
                          else optimizer_state),
            "controller": self.controller.state_dict() if self.controller else None,
            "rng": ckpt_io.to_weights_only(ckpt_io.rng_state()),
            "data": {"seed": self.cfg.run.seed, "next_step": self.step},
            # the metrics line of this step: a resume restores it if the file lost it
            "last_record": getattr(getattr(self, "metrics", None), "last", None),
        }

    def _load(self, ckpt: Path, state: dict[str, Any]) -> None:
        load_checkpoint(ckpt, state, self.model, self.optimizer, self.ep, self.fsdp, self.device)
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.total_flops, self.elapsed = float(state["flops"]), float(state["elapsed"])
        ckpt_io.set_rng_state(state["rng"])

    def save(self) -> Path | None:
        if self.dist.enabled:  # every rank must hold the same lambda
            self.control.check_ranks_agree(self.device, self.step)
        if self.dist.is_main:  # the lines a resume from this checkpoint keeps are on disk first
            self.metrics.sync()
            self.evals.sync()
        if self.fsdp is not None:  # sharded (remoe.distributed.dcp): every rank writes its shards
            path = dcp.save_sharded(self.ckpt_root, self.step, self.model, self.optimizer,
                                    self._state({}), self.cfg.train.keep_last, self.ep)
            self._saved_step = self.step
            return path if self.dist.is_main else None
        path = None
        with self._full_experts():
            optim = None
            if self.ep is not None:  # every rank's expert optimizer state, gathered (collective)
                optim = self.ep.gather_optimizer_state(self.optimizer)
            if self.dist.is_main:
                path = ckpt_io.save_checkpoint(self.ckpt_root, self.step, self.model,
                                               self._state(optim), self.tokenizer_path,
                                               self.cfg.train.keep_last,
                                               self.cfg.train.keep_optimizer)
        self._saved_step = self.step
        self._barrier()
        return path

    # -- one optimizer step -------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self) -> dict[str, Any]:
        tc = self.cfg.train
        step = self.step
        if self.lr_start is None:
            lr = cosine_lr(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps)
        else:  # train.init_lr: no warm-up, cosine from the start lr (remoe.train.init_from)
            lr = cosine_lr(step, self.lr_start, min(tc.min_lr, self.lr_start), 0, tc.max_steps)
        set_lr(self.optimizer, lr)
        control = self.control  # the routing side of the step (control.py)
        coeff, layer_coeffs = control.coeffs()
        revive = control.revive_masks()
        threads = self.threads.before_step(step) if self.threads else torch.get_num_threads()
        t0 = time.perf_counter()
        self.model.train()
        plan = self.capacity  # train.dispatch_plan=capacity (control.CapacityPlan)
        rng = ckpt_io.rng_state() if plan is not None else None  # a redo: the same draws
        caps, attempt = None, 0
        while True:
            tot, tokens_micro, caps = self._forward_backward(step, coeff, layer_coeffs, revive,
                                                             caps)
            if plan is None or not tot.overflow:
                break
            # a plan was cut: drop the step's gradients and sums, redo it with the pairs the
            # cut step counted (then full), so that the step is the exact plan's
            attempt += 1
            caps = plan.refit(tot.pairs_max_L, tokens_micro, attempt)
            self.optimizer.zero_grad(set_to_none=True)
            control.discard()
            ckpt_io.set_rng_state(rng)
        if plan is not None:
            plan.record(tot.pairs_max_L, tokens_micro)
        check_finite_losses(self.optimizer, step, tot.lm, tot.reg, tot.aux, self.ckpt_root)
        grad_norm = tot.grad_norm
        update(self.optimizer, grad_norm, step, self.ckpt_root)
        stats = control.after_step(tot)  # statistics, routers' and controller's updates
        control.split_dead(tot.counts_LN, self.optimizer, self.cfg.run.seed, step)
        step_flops = self.flops.train_flops(int(tot.tokens),
                                            self.flops.effective_pairs(stats.active_pairs,
                                                                       int(tot.tokens)))
        # no torch.cuda.synchronize() here: the step's one copy to the host (above) already
        # waited for its forward and backward; the optimizer kernels queued after it are timed
        # with the next step
        dt = time.perf_counter() - t0
        if self.threads:
            self.threads.after_step(step, dt)
        self.step += 1
        self.tokens += int(tot.tokens)
        self.total_flops += step_flops
        self.elapsed += dt
        return {
            "step": self.step, "tokens": self.tokens, "flops": self.total_flops, "lr": lr,
            "loss": tot.lm + penalty(coeff, tot.reg, layer_coeffs, tot.reg_L) + tot.aux,
            "lm_loss": tot.lm, "reg_loss": tot.reg, "aux_loss": tot.aux,
            "lambda": coeff, "sparsity": stats.sparsity, "layer_sparsity": stats.layer_sparsity,
            "expert_counts": tot.counts_LN.tolist(), "active_k": stats.active_k,
            "step_tokens": int(tot.tokens), "grad_norm": grad_norm,
            "tokens_per_s": tot.tokens / dt, "elapsed_s": self.elapsed, "threads": threads,
            # experts that received no token in this step, per MoE layer
            "dead_experts": stats.dead_experts,
            "layer_active_k": stats.layer_active_k, "effective_experts": stats.effective_experts,
            **control.record(layer_coeffs, tot.reg_L),
            # capacity plan: each MoE layer's capacity in the step, and whether it was redone
            **({"plan_capacity": caps, "plan_redone": attempt} if plan is not None else {}),
        }

    def _forward_backward(self, step: int, coeff: float, layer_coeffs, revive, caps):
        """The step's micro-batches, forward and backward, then clipping and the step's one
        all-reduce and copy to the host: ``(StepTotals, tokens per micro-batch, capacities)``.
        ``caps``: each MoE layer's plan capacity (capacity plan; None: the plan's own choice)."""
        tc = self.cfg.train
        tokens_micro = 0
        # train.cast_experts_once: the expert weights cast to the autocast dtype once for all
        # micro-batches (remoe.model.experts.cast_once_per_step; fp32: nothing to cast)
        cast = self.autocast_dtype if tc.cast_experts_once else None
        with cast_once_per_step(self.model, cast):
            batches = device_batches(self.sampler, step, self.dist.rank, tc.grad_accum,
                                     self.device, tc.pin_memory, tc.prefetch, self.copy_stream)
            for micro, input_ids in enumerate(batches):
                tokens_micro, caps = self._micro_step(step, micro, input_ids, coeff,
                                                      layer_coeffs, revive, caps)
        # clip first: the norm goes to the host in the same copy as the step's sums, the step's
        # one host synchronisation outside the model
        norm = finish_and_clip(self.model, tc.grad_clip, self.fsdp or self.ep)
        return (self.control.reduce(self.device, self.dist.enabled, grad_norm=norm),
                tokens_micro, caps)

    def _micro_step(self, step: int, micro: int, input_ids, coeff: float, layer_coeffs, revive,
                    caps):
        """One micro-batch's forward and backward; ``(tokens, capacities)``."""
        tc = self.cfg.train
        model = self.wrapped
        tokens_micro = input_ids.numel()
        if self.capacity is not None and caps is None:
            caps = self.capacity.capacities(tokens_micro)
        sync = (micro == tc.grad_accum - 1) or not hasattr(model, "no_sync")
        extra = {"capacity": caps} if caps is not None else {}
        if tc.loss_chunk_tokens:
            extra["loss_chunk_tokens"] = tc.loss_chunk_tokens
        with (nullcontext() if sync else model.no_sync()), self._autocast():
            out = model(input_ids=input_ids, labels=input_ids, train_step=step, revive=revive,
                        **extra)
            loss = total_loss(out, coeff, layer_coeffs)
        (loss / tc.grad_accum).backward()
        self.control.add(out, tokens_micro)
        return tokens_micro, caps

    # -- periodic work ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        from remoe.model.losses import evaluate_loss

        res = evaluate_loss(self.model, self._eval_batches(), list(self.data.domains),
                            device=self.device)
        rec = {"step": self.step, "tokens": self.tokens, "val_loss": res["loss"],
               "val_ppl": res["ppl"],
               "domains": {d: v["loss"] for d, v in res["domains"].items()}}
        self.last_eval = rec
        if self.dist.is_main:
            self.evals.write(rec)
            if self.tb:
                self.tb.add_scalar("val/loss", rec["val_loss"], self.step)
        return rec

    def record_masks(self) -> None:
        if self.calib is None or not (self.dist.is_main or self.ep is not None
                                      or self.fsdp is not None):  # collective forwards
            return
        record_masks(self.model, self.calib, self.device, self.run_dir, self.step,
                     self.dist.is_main)

    def _log(self, rec: dict[str, Any], bar) -> None:
        if not self.dist.is_main:
            return
        self.metrics.write(rec)
        if self.tb:
            for k in ("loss", "lm_loss", "reg_loss", "aux_loss", "lambda", "sparsity", "lr",
                      "tokens_per_s", "grad_norm"):
                self.tb.add_scalar(f"train/{k}", rec[k], rec["step"])
        if bar is not None:
            bar.set_postfix_str(f"{stats_text(rec)}  {rec['tokens_per_s']:,.0f} tok/s")
            bar.update(1)
            return
        if self.lines is None:
            self.lines = ProgressLines(self.cfg.train.max_steps, self.cfg.train.log_every)
        self.lines.update(rec)

    def _should_stop(self) -> str | None:
        return stop_reason(self.cfg.train, self.step, self.tokens, self.total_flops)

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        tc, ac = self.cfg.train, self.cfg.analysis
        bar = open_progress(self.cfg.run.name, self.step, tc.max_steps, tc.log_every,
                            bar=self.progress, main=self.dist.is_main)
        if self.step == 0 and ac.record_masks_every:
            self.record_masks()
        reason = self._should_stop()
        last_rec = None
        # Ctrl-C or SIGTERM: the step in progress finishes, then a checkpoint (runtime.py)
        ctrl_c = StopOnInterrupt(enabled=not self.dist.enabled)
        try:
            with ctrl_c:
                while reason is None:
                    rec = self.train_step()
                    last_rec = rec
                    self._log(rec, bar)
                    if ac.record_masks_every and self.step % ac.record_masks_every == 0:
                        self.record_masks()
                    if tc.eval_every and self.step % tc.eval_every == 0:
                        self.evaluate()
                    reason = self._should_stop()
                    if tc.save_every and self.step % tc.save_every == 0 and reason is None:
                        self.save()
                    if ctrl_c.requested and reason is None:
                        if self._saved_step != self.step:
                            self.save()
                        raise TrainingInterrupted(
                            self.step, self.ckpt_root / f"step_{self.step:07d}", ctrl_c.signum)
        finally:
            if bar is not None:
                bar.close()
        # finishing is idempotent: a resumed finished run (or one stopped after its last
        # checkpoint) neither validates nor checkpoints the same step twice
        if self.last_eval is None or self.last_eval["step"] != self.step:
            self.evaluate()
        if self._saved_step != self.step:
            self.save()
        summary = self._finish(reason, last_rec)
        return summary

    def _finish(self, reason: str, last: dict[str, Any] | None) -> dict[str, Any]:
        with self._full_experts():  # EP: count and save all experts
            return self._finish_full(reason, last)

    def _finish_full(self, reason: str, last: dict[str, Any] | None) -> dict[str, Any]:
        final_dir = self.run_dir / "final"
        totals = {"steps": self.step, "tokens": self.tokens, "flops": self.total_flops,
                  "elapsed_s": self.elapsed}
        summary = run_summary(self.run_dir, reason, totals, self.model, self.model_cfg,
                              self.controller.coeff if self.controller else None, last,
                              self.last_eval, final_dir,
                              stages=self.model_cfg.is_moe and self.dist.is_main)
        # FSDP: the full weights gathered (collective) into a plain copy on rank 0
        to_write = self.fsdp.consolidated_model() if self.fsdp is not None else self.model
        if self.dist.is_main:
            ckpt_io.write_model_dir(final_dir, to_write, self.tokenizer_path)
            ckpt_io.atomic_write_text(self.run_dir / "summary.json",
                                      rundir.dumps_json(summary, indent=2))
            self.metrics.close()
            self.evals.close()
            if self.tb:
                self.tb.close()
            self.close()
        self._barrier()
        return summary

    def close(self) -> None:
        """Release the run directory (its lock); also done at the end of :meth:`train`."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
