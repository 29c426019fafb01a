"""The training loop.

One optimizer step = ``grad_accum`` micro-batches on every data-parallel rank:

    for each micro-batch: out = model(x, labels=x, train_step=step)
        loss = L_lm + lambda_i * L_reg + L_aux          (lambda_i from the controller)
        (loss / grad_accum).backward(); accumulate routing counts as tensors
    all-reduce the step's statistics once -> S_i, per-layer sparsity, expert counts
    clip, optimizer step, LR schedule; controller.update(S_i)  (same lambda on every rank)
    metrics line (JSONL), progress, periodic validation / mask recording / atomic checkpoint

Batches are a pure function of (seed, step, micro-step, rank), and RNG states, optimizer,
scheduler and controller are checkpointed, so ``resume`` continues bit-exactly on CPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from remoe import rundir
from remoe import registry
from remoe.errors import ConfigError
from remoe.model import ReMoEForCausalLM
from remoe.model.routers import Router
from remoe.losses import total_loss
from remoe.sparsity import build_controller
from remoe.threads import ThreadTuner, usable_cores
from remoe.train import checkpoint as ckpt_io
from remoe.train.config import ExperimentConfig
from remoe.train.flops import FlopCounter


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


# ----------------------------------------------------------------------------- set-up helpers

# set-up pieces live in their own modules (re-exported here for existing imports)
from remoe.train.distributed import DistInfo, init_distributed, resolve_device  # noqa: E402,F401
from remoe.train.metrics import MetricsWriter, format_summary  # noqa: E402,F401
from remoe.train.rng import rng_state, set_rng_state, to_weights_only  # noqa: E402,F401
from remoe.train.schedule import cosine_lr  # noqa: E402,F401


# ----------------------------------------------------------------------------- the trainer

class Trainer:
    """Runs an :class:`ExperimentConfig`; ``train()`` returns the end-of-run summary dict."""

    def __init__(self, cfg: ExperimentConfig, resume: bool = False, progress: bool | None = None,
                 data=None) -> None:
        self.cfg = cfg
        self.resume = resume
        tc = cfg.train
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bars at every checkpoint
        self.threads = None  # train.num_threads=N: fixed; null: chosen by measurement
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            self.threads = ThreadTuner(usable_cores(local), probe_every=tc.thread_probe_every)
        want_cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
        self.dist = init_distributed("cuda" if want_cuda else "cpu")
        self.device = resolve_device(tc.device, self.dist)
        precision = tc.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.dist.is_main
        self.run_dir = cfg.run_dir
        # config.yaml records where the data lives, usable from any working directory
        cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())

        # data (rank 0 builds the cache, the others then load it)
        if data is None:
            from remoe.data import prepare_data

            if self.dist.is_main:
                data = prepare_data(cfg.data, progress=self.progress)
            self._barrier()
            if not self.dist.is_main:
                data = prepare_data(cfg.data, progress=False)
        self.data = data
        self.sampler = data.train_batches(seq_len=tc.seq_len, micro_batch=tc.micro_batch_size,
                                          grad_accum=tc.grad_accum,
                                          world_size=self.dist.world_size, seed=cfg.run.seed)

        # model
        torch.manual_seed(cfg.run.seed)
        vocab = _round_up(data.vocab_size, 64)
        self.model_cfg = cfg.model_config(vocab_size=vocab, eos_token_id=data.eos_id,
                                          bos_token_id=data.eos_id, pad_token_id=data.eos_id)
        if self.model_cfg.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size={self.model_cfg.vocab_size} must be >= the "
                              f"tokenizer's vocabulary ({data.vocab_size})")
        self.model = ReMoEForCausalLM(self.model_cfg).to(self.device)
        self.ep = self._setup_expert_parallel()  # None unless expert parallel under torchrun
        self.flops = FlopCounter(self.model_cfg, tc.seq_len)
        # the token router of every MoE layer, in the order of the rows of the expert counts
        self.token_routers = [r for r in (getattr(b.ffn, "router", None) for b in self.model.layers)
                              if isinstance(r, Router)]
        # the paper's single lambda by default; per-layer / PI / revival on request
        self.controller = build_controller(self.model_cfg, len(self.token_routers))
        self.optimizer = self._build_optimizer()
        self.step = 0
        self.tokens = 0
        self.total_flops = 0.0
        self.elapsed = 0.0
        self.best_val: float | None = None
        self.last_eval: dict[str, Any] | None = None

        self.ckpt_root = self.run_dir / "checkpoints"
        # the run directory defends itself (remoe.rundir): one writer, no leftovers of
        # interrupted writes, no fresh run over an old one, only verified checkpoints resumed
        self.lock: rundir.RunLock | None = None
        try:
            resume_from, state = None, None
            if self.dist.is_main:
                self.lock = rundir.RunLock.acquire(self.run_dir)
                rundir.remove_interrupted_writes(self.run_dir)
                if resume:
                    resume_from, state = ckpt_io.find_resume_checkpoint(self.ckpt_root)
                    if resume_from is not None:
                        ckpt_io.check_resume_config(self.run_dir, cfg.to_dict(), cfg.to_yaml(),
                                                    int(state["step"]))
                else:
                    rundir.require_fresh(self.run_dir)
            self._barrier()
            if resume and not self.dist.is_main:
                resume_from, state = ckpt_io.find_resume_checkpoint(self.ckpt_root, report=False)
            if resume and resume_from is None:
                raise ConfigError(f"--resume: no checkpoint found under {self.ckpt_root}")
            self._saved_step = None  # the step of the newest checkpoint on disk
            if resume_from is not None:
                self._load(resume_from, state)
                self._saved_step = self.step
                # a finished run's (or a run stopped after its last checkpoint) validation of
                # this step is on disk: finishing again must not repeat it
                evals, _ = (rundir.read_jsonl(self.run_dir / "eval.jsonl")
                            if (self.run_dir / "eval.jsonl").exists() else ([], []))
                done = [rec for _, rec in evals if rec.get("step") == self.step]
                self.last_eval = done[-1] if done else None
            self.wrapped = self._wrap_model()
            self.calib = self._calibration_set()
            if self.dist.is_main:
                ckpt_io.atomic_write_text(self.run_dir / "config.yaml", cfg.to_yaml())
                rs = self.step if resume_from is not None else None
                self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", rs)
                self.evals = MetricsWriter(self.run_dir / "eval.jsonl", rs)
                self.tb = self._tensorboard()
        except BaseException:  # a refused or failed start releases the run directory
            self.close()
            raise

    # -- construction helpers ---------------------------------------------------------------
    def _barrier(self) -> None:
        if self.dist.enabled:
            dist.barrier()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        tc = self.cfg.train
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            # norms and the routers' weights (whose scale IS the routing) get no weight decay
            (no_decay if p.ndim < 2 or ".router." in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": tc.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                                 foreach=self.device.type == "cuda")

    def _wrap_model(self):
        if not self.dist.enabled:
            return self.model
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.ep is not None:  # each rank owns different experts: DDP must not touch them
            DDP._set_params_and_buffers_to_ignore_for_model(self.model, list(self.ep.params))
        return DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   find_unused_parameters=not registry.declares(self.model_cfg.router,
                                                                "uses_all_params"))

    # -- expert parallelism (train.expert_parallel; see remoe.model.expert_parallel) --------
    def _setup_expert_parallel(self):
        """Replace every MoE layer's experts by this rank's slice (None: off or one process)."""
        tc = self.cfg.train
        if not tc.expert_parallel:
            return None
        from remoe.model.expert_parallel import check_expert_parallel, shard_experts

        mc = self.model_cfg
        check_expert_parallel(mc.router, mc.num_experts * mc.granularity, self.dist.world_size)
        if not self.dist.enabled:
            return None
        # a group of its own: the expert exchanges never interleave with DDP's all-reduces
        return shard_experts(self.model, dist.new_group())

    def _full_experts(self):
        """Collective under EP: all experts gathered into self.model inside (save, counts)."""
        return self.ep.full_experts() if self.ep is not None else nullcontext()

    def _tensorboard(self):
        if not self.cfg.train.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise ConfigError("train.tensorboard=true needs the tensorboard package "
                              "(pip install tensorboard)") from e
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def _calibration_set(self) -> torch.Tensor | None:
        ac = self.cfg.analysis
        if ac.record_masks_every <= 0 or not self.model_cfg.is_moe:
            return None
        seq = self.cfg.train.seq_len
        n = max(1, math.ceil(ac.calib_tokens / seq))  # sequences in the calibration set
        per_domain = max(1, math.ceil(n / max(1, len(self.data.domains))))
        rows = [ids[:, :seq] for ids, _ in self.data.eval_batches(
            "validation", seq_len=seq, batch_size=n, max_chunks_per_domain=per_domain)]
        if not rows:
            return None
        ids = torch.cat(rows)  # domain after domain
        # interleave the domains so that keeping n sequences keeps every domain
        return ids[_round_robin(ids.shape[0], per_domain)][:n]

    def _eval_batches(self):
        tc = self.cfg.train
        return self.data.eval_batches("validation", seq_len=tc.seq_len,
                                      batch_size=tc.eval_batch_size,
                                      max_chunks_per_domain=tc.eval_chunks_per_domain)

    # -- checkpoint state ---------------------------------------------------------------------
    def _state(self, optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "step": self.step, "tokens": self.tokens, "flops": self.total_flops,
            "elapsed": self.elapsed,
            "optimizer": (self.optimizer.state_dict() if optimizer_state is None
                          else optimizer_state),
            "controller": self.controller.state_dict() if self.controller else None,
            "rng": to_weights_only(rng_state()),
            "data": {"seed": self.cfg.run.seed, "next_step": self.step},
        }

    def _load(self, ckpt: Path, state: dict[str, Any] | None = None) -> None:
        from safetensors.torch import load_file

        if state is None:
            state = ckpt_io.load_trainer_state(ckpt)
        weights = load_file(str(ckpt / "model.safetensors"), device=str(self.device))
        optimizer_state = state["optimizer"]
        if self.ep is not None:  # checkpoints hold every expert: keep this rank's slices
            weights = self.ep.shard_state_dict(weights)
            optimizer_state = self.ep.shard_optimizer_state(optimizer_state, self.optimizer)
        try:
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
        except RuntimeError as e:  # size mismatch: the model config changed
            first = str(e).strip().splitlines()[1:2] or [str(e)[:200]]
            raise ConfigError(f"--resume: checkpoint {ckpt} does not match the model config "
                              f"({first[0].strip()})") from None
        if unexpected or [m for m in missing if m in dict(self.model.named_parameters())]:
            raise ConfigError(f"--resume: checkpoint {ckpt} does not match the model config "
                              f"(missing={missing[:3]}, unexpected={unexpected[:3]})")
        self.optimizer.load_state_dict(optimizer_state)
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.total_flops, self.elapsed = float(state["flops"]), float(state["elapsed"])
        set_rng_state(state["rng"])

    def _check_ranks_agree(self) -> None:
        """Every rank must hold the same lambda (it is updated from all-reduced statistics)."""
        if not self.dist.enabled or self.controller is None:
            return
        values = self.controller.layer_coeffs or [self.controller.coeff]  # every layer's lambda
        lam = torch.tensor(values + [-v for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(lam, op=dist.ReduceOp.MAX)
        n = len(values)
        if not torch.equal(lam[:n], -lam[n:]):
            raise RuntimeError(f"ranks disagree on lambda at step {self.step}: "
                               f"max {lam[:n].tolist()} vs min {(-lam[n:]).tolist()}")

    def save(self) -> Path | None:
        self._check_ranks_agree()
        path = None
        with self._full_experts():
            optim = None
            if self.ep is not None:  # every rank's expert optimizer state, gathered (collective)
                optim = self.ep.gather_optimizer_state(self.optimizer)
            if self.dist.is_main:
                path = ckpt_io.save_checkpoint(self.ckpt_root, self.step, self.model,
                                               self._state(optim),
                                               getattr(self.data, "tokenizer_path", None),
                                               self.cfg.train.keep_last)
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
        model, step = self.wrapped, self.step
        lr = cosine_lr(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        coeff = self.controller.coeff if self.controller else 0.0
        layer_coeffs = self.controller.layer_coeffs if self.controller else None
        self._arm_revival()
        threads = self.threads.before_step(step) if self.threads else torch.get_num_threads()
        t0 = time.perf_counter()
        self.model.train()
        sums = torch.zeros(4, dtype=torch.float64)  # lm, reg, aux, tokens (per rank)
        counts = None
        reg_L = None  # per-layer control: sum over micro-batches of each layer's L_reg
        for micro in range(tc.grad_accum):
            input_ids, _ = self.sampler.batch(step, micro, self.dist.rank)
            input_ids = input_ids.to(self.device, non_blocking=True)
            sync = (micro == tc.grad_accum - 1) or not hasattr(model, "no_sync")
            with (nullcontext() if sync else model.no_sync()), self._autocast():
                out = model(input_ids=input_ids, labels=input_ids, train_step=step)
                aux = out.aux
                loss = total_loss(out, coeff, layer_coeffs)
            (loss / tc.grad_accum).backward()
            sums += torch.stack([out.loss.detach().double().cpu(),
                                 aux.reg_loss.detach().double().cpu(),
                                 aux.aux_loss.detach().double().cpu(),
                                 torch.tensor(float(input_ids.numel()), dtype=torch.float64)])
            c = aux.active_counts_LN.detach().double().cpu()
            counts = c if counts is None else counts + c
            if layer_coeffs is not None:
                r = aux.reg_losses_L.detach().double().cpu()
                reg_L = r if reg_L is None else reg_L + r
        # one reduction of everything the step reports
        packed = torch.cat([sums, counts.flatten()] + ([reg_L] if reg_L is not None else []))
        if self.dist.enabled:
            packed = packed.to(self.device)
            dist.all_reduce(packed)
            packed = packed.cpu()
        n_micro = tc.grad_accum * self.dist.world_size
        lm, reg, aux_l, step_tokens = (packed[:4] / torch.tensor([n_micro, n_micro, n_micro, 1])).tolist()
        counts_LN = packed[4:4 + counts.numel()].view_as(counts)
        if reg_L is not None:
            reg_L = (packed[4 + counts.numel():] / n_micro).tolist()
        if not all(math.isfinite(v) for v in (lm, reg, aux_l)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"loss became non-finite at step {step + 1} (lm_loss={lm}, "
                                   f"reg_loss={reg}, aux_loss={aux_l}); stopping. Last good "
                                   f"checkpoint: {ckpt_io.latest_checkpoint(self.ckpt_root)}")
        if self.ep is not None:
            self.ep.finish_grads()  # expert grads: sum over ranks -> mean, as DDP does
        grad_norm = self._clip()
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"gradient norm became non-finite at step {step + 1}; stopping. "
                                   f"Last good checkpoint: "
                                   f"{ckpt_io.latest_checkpoint(self.ckpt_root)}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for router, counts_N in zip(self.token_routers, counts_LN):  # no-op but topk_auxfree
            router.after_step(counts_N)

        reg_term = (coeff * reg if reg_L is None  # lambda * L_reg as the step's loss used it
                    else sum(a * b for a, b in zip(layer_coeffs, reg_L)) / len(reg_L))
        L, N = counts_LN.shape
        tokens_per_layer = step_tokens  # every layer sees every token
        active_pairs = float(counts_LN.sum())
        sparsity = 1.0 - active_pairs / (L * tokens_per_layer * N) if L else 0.0
        layer_sparsity = (1.0 - counts_LN.sum(1) / (tokens_per_layer * N)).tolist() if L else []
        if self.controller is not None:
            self.controller.update(sparsity, layer_sparsity, counts_LN.tolist())
        step_flops = self.flops.train_flops(int(step_tokens),
                                            self.flops.effective_pairs(active_pairs, int(step_tokens)))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if self.threads:
            self.threads.after_step(step, dt)
        self.step += 1
        self.tokens += int(step_tokens)
        self.total_flops += step_flops
        self.elapsed += dt
        return {
            "step": self.step, "tokens": self.tokens, "flops": self.total_flops, "lr": lr,
            "loss": lm + reg_term + aux_l, "lm_loss": lm, "reg_loss": reg, "aux_loss": aux_l,
            "lambda": coeff, "sparsity": sparsity, "layer_sparsity": layer_sparsity,
            "expert_counts": counts_LN.tolist(), "active_k": (active_pairs / (L * step_tokens)
                                                              if L else 0.0),
            "step_tokens": int(step_tokens), "grad_norm": grad_norm,
            "tokens_per_s": step_tokens / dt, "elapsed_s": self.elapsed, "threads": threads,
            # experts that received no token in this step, per MoE layer
            "dead_experts": (counts_LN == 0).sum(1).tolist() if L else [],
            **self._control_record(layer_coeffs, reg_L),
        }

    def _control_record(self, layer_coeffs, reg_L) -> dict[str, Any]:
        """Metrics of the sparsity-control options (nothing for the paper's controller)."""
        rec: dict[str, Any] = {}
        if layer_coeffs is not None:
            rec["lambda_layers"] = layer_coeffs  # the coefficients used in this step
            rec["reg_loss_layers"] = reg_L
        dead = self.controller.dead_experts() if self.controller else None
        if dead is not None:
            rec["reviving"] = [sum(row) for row in dead]  # experts under revival next step
        return rec

    def _arm_revival(self) -> None:
        """Hand each ReLU router the experts whose revival hinge is on for this step."""
        dead = self.controller.dead_experts() if self.controller else None
        if dead is None:
            return
        for router, row in zip(self.token_routers, dead):  # revival: ReLU routers only
            router.set_dead_experts(torch.tensor(row, dtype=torch.bool))

    def _clip(self) -> float:
        clip = self.cfg.train.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.ep is not None:  # global norm: replicated grads once + every rank's experts
            return float(self.ep.clip_grad_norm_(params, clip))
        if clip > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, clip))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    # -- periodic work ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        from remoe.losses import evaluate_loss

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

    @torch.no_grad()
    def record_masks(self) -> None:
        if self.calib is None or not (self.dist.is_main or self.ep is not None):
            return
        self.model.eval()
        out = self.model(input_ids=self.calib.to(self.device), record_masks=True)
        if not self.dist.is_main:  # EP: every rank takes part in the forward; rank 0 writes
            self.model.train()
            return
        masks = torch.stack([m.cpu() for m in out.aux.masks]).numpy()  # [L, T, N]
        out_dir = self.run_dir / "routing"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"masks_{self.step:07d}.npz"
        tmp = out_dir / f".masks_{self.step:07d}.tmp.npz"
        np.savez_compressed(tmp, masks=np.packbits(masks, axis=-1), shape=np.array(masks.shape),
                            token_ids=self.calib.reshape(-1).numpy(), step=np.array(self.step))
        os.replace(tmp, path)
        self.model.train()

    def _log(self, rec: dict[str, Any], bar) -> None:
        if not self.dist.is_main:
            return
        self.metrics.write(rec)
        if self.tb:
            for k in ("loss", "lm_loss", "reg_loss", "aux_loss", "lambda", "sparsity", "lr",
                      "tokens_per_s", "grad_norm"):
                self.tb.add_scalar(f"train/{k}", rec[k], rec["step"])
        stats = (f"lm {rec['lm_loss']:.3f}  S {rec['sparsity']:.3f}  "
                 f"lambda {rec['lambda']:.2e}  lr {rec['lr']:.2e}")
        if bar is not None:
            bar.set_postfix_str(f"{stats}  {rec['tokens_per_s']:,.0f} tok/s")
            bar.update(1)
            return
        # no terminal (e.g. `remoe train > log 2>&1`): a line every log_every steps and at least
        # every 30 s, with the step of the total, tokens/s since the last line and the ETA
        now, total = time.monotonic(), self.cfg.train.max_steps
        if getattr(self, "_progress_start", None) is None:  # (wall time, step, tokens) before it
            step_s = rec["step_tokens"] / max(rec["tokens_per_s"], 1e-9)
            self._progress_start = self._progress_last = (now - step_s, rec["step"] - 1,
                                                          rec["tokens"] - rec["step_tokens"])
        every = self.cfg.train.log_every
        if not every or not (rec["step"] % every == 0 or rec["step"] in (1, total)
                             or now - self._progress_last[0] >= 30.0):
            return
        t0, _, k0 = self._progress_last
        rate = (rec["tokens"] - k0) / max(now - t0, 1e-9)
        ts, ss, _ = self._progress_start
        left = (now - ts) / max(rec["step"] - ss, 1) * max(total - rec["step"], 0)
        eta = f"{int(left // 60)}m{int(left % 60):02d}s"
        print(f"step {rec['step']:>5}/{total} ({100 * rec['step'] / max(total, 1):3.0f}%)  "
              f"{stats}  {rate:,.0f} tok/s  ETA {eta}", flush=True)
        self._progress_last = (now, rec["step"], rec["tokens"])

    def _should_stop(self) -> str | None:
        tc = self.cfg.train
        if self.step >= tc.max_steps:
            return f"reached train.max_steps={tc.max_steps}"
        if tc.max_tokens is not None and self.tokens >= tc.max_tokens:
            return f"reached train.max_tokens={tc.max_tokens}"
        if tc.max_flops is not None and self.total_flops >= tc.max_flops:
            return f"reached train.max_flops={tc.max_flops:.3g}"
        return None

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        tc, ac = self.cfg.train, self.cfg.analysis
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=tc.max_steps, initial=self.step, desc=self.cfg.run.name,
                       dynamic_ncols=True)
        elif self.dist.is_main and tc.log_every:
            print(f"training {self.cfg.run.name}: steps {self.step + 1}-{tc.max_steps}; a line "
                  f"every {tc.log_every} steps or 30 s (tokens/s since the previous line, ETA)",
                  flush=True)
        if self.step == 0 and ac.record_masks_every:
            self.record_masks()
        reason = self._should_stop()
        last_rec = None
        try:
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

    def _stages(self):
        """Stage boundaries of the logged run (the definitions of ``remoe analyze stages``)."""
        if self.controller is None or not self.dist.is_main:
            return None
        from remoe.stages import detect_stages

        recs = [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines()
                if x.strip()]
        if not recs:
            return None
        return detect_stages([r["step"] for r in recs], [r["sparsity"] for r in recs],
                             self.model_cfg.target_sparsity,
                             [r["lambda"] * r["reg_loss"] for r in recs],
                             [r["lm_loss"] for r in recs])

    def _finish(self, reason: str, last: dict[str, Any] | None) -> dict[str, Any]:
        with self._full_experts():  # EP: count and save all experts
            return self._finish_full(reason, last)

    def _finish_full(self, reason: str, last: dict[str, Any] | None) -> dict[str, Any]:
        final_dir = self.run_dir / "final"
        if last is None:  # the loop ran no step (resume of a finished run): the logged last step
            path = self.run_dir / "metrics.jsonl"
            logged = [rec for _, rec in (rundir.read_jsonl(path)[0] if path.exists() else [])]
            last = logged[-1] if logged and logged[-1].get("step") == self.step else None
        stages = self._stages()
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir), "stop_reason": reason, "steps": self.step,
            "tokens": self.tokens, "flops": self.total_flops, "elapsed_s": self.elapsed,
            "tokens_per_s": self.tokens / self.elapsed if self.elapsed else None,
            "router": self.model_cfg.router,
            "params_total": self.model.num_parameters(),
            "params_active": self.model.num_parameters(active=True),
            "target_sparsity": self.model_cfg.target_sparsity if self.model_cfg.is_moe else None,
            "final_lm_loss": last["lm_loss"] if last else None,
            "final_sparsity": last["sparsity"] if last else None,
            "final_lambda": self.controller.coeff if self.controller else None,
            "stage2_start": stages.stage2_start if stages else None,
            "settling_step": stages.settle_step if stages else None,
            "val_loss": self.last_eval["val_loss"] if self.last_eval else None,
            "val_domains": self.last_eval["domains"] if self.last_eval else None,
            "final_dir": str(final_dir),
        }
        if self.dist.is_main:
            ckpt_io.write_model_dir(final_dir, self.model,
                                    getattr(self.data, "tokenizer_path", None))
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


def _round_robin(total: int, per_group: int) -> torch.Tensor:
    """Indices visiting consecutive groups of ``per_group`` rows in turn (one row each)."""
    idx = torch.arange(total)
    groups = (total + per_group - 1) // per_group
    key = (idx % per_group) * groups + idx // per_group
    return idx[key.argsort()]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
