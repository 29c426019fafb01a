"""ReMoE's sparsity control inside transformers' ``Trainer`` (docs/FINETUNE.md).

``ReMoETrainer`` (or :class:`ReMoETrainerMixin` in front of another ``Trainer`` subclass)
trains a remoe model -- plain, under PEFT, with gradient checkpointing, under DDP -- with the
objective of remoe's own trainer, ``L_lm + lambda * L_reg + L_aux`` (remoe.method.sparsity):

* ``compute_loss`` adds ``lambda * L_reg + L_aux`` to the model's LM loss in training
  (evaluation reports the LM loss alone, as remoe does). The LM loss honours
  ``num_items_in_batch`` (the model normalises it by the tokens of the whole accumulated
  batch), so the extra term is divided by the accumulation steps the same way;
* the step runs the sequence of ``remoe train`` (:class:`remoe.train.control.StepControl`):
  each micro-batch's losses and routing counts are summed (and its forward gets the experts
  under revival, ``revive=``); after every optimizer step (:class:`SparsityCallback`,
  ``on_step_end``) they are all-reduced over the ranks once, and the routers' ``after_step``
  and the controller (:mod:`remoe.method.sparsity`) are updated from the step's sparsity --
  the same lambda on every rank;
* the controller's state is written into every Trainer checkpoint (``remoe_sparsity.json``)
  and read back by ``train(resume_from_checkpoint=...)``;
* ``lambda``, ``sparsity`` and ``reg_loss`` are added to the Trainer's training logs.

Lambda starts (``init_lambda``) where it fits the model (``"auto"``, the rule of
``remoe train --set train.init_from``, :func:`remoe.train.init_lambda.pick_lambda`): the lambda
the remoe run that saved the model ended with, else the gradient balance at the routers on the
first micro-batch when the model is denser than its target, else ``model.lambda0``; or the
config's ``lambda0`` (``"config"``: the paper's start, meant for training from scratch); or a
number.
``revive_method: split`` needs remoe's own trainer (it edits the optimizer state) and is
refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from remoe.errors import ConfigError

STATE_FILE = "remoe_sparsity.json"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def active_router(router):
    """The router that runs: through PEFT's ``ModulesToSaveWrapper`` (a trained copy) or a
    LoRA wrapper (its base layer)."""
    from remoe.model.routers import Router

    while not isinstance(router, Router):
        if hasattr(router, "modules_to_save") and hasattr(router, "original_module"):
            names = [a for a in router.active_adapters if a in router.modules_to_save]
            router = (router.modules_to_save[names[0]] if names and not router.disable_adapters
                      else router.original_module)
        elif hasattr(router, "get_base_layer"):
            router = router.get_base_layer()
        else:
            raise TypeError(f"not a remoe router: {type(router).__name__}")
    return router


def token_routers(model) -> list:
    """The active token router of every MoE layer of ``model`` (any wrapping), in layer order."""
    from remoe.model.moe import MoELayer

    return [active_router(m.router) for m in model.modules() if isinstance(m, MoELayer)]


def remoe_config(model):
    """The ReMoEConfig of a remoe model, a PEFT model around one, or a DDP wrapper."""
    seen = model
    for _ in range(8):
        cfg = getattr(seen, "config", None)
        if getattr(cfg, "model_type", None) == "remoe":
            return cfg
        seen = getattr(seen, "module", None) or getattr(seen, "base_model", None) or \
            getattr(seen, "model", None)
        if seen is None:
            break
    raise TypeError("ReMoETrainer needs a remoe model (ReMoEForCausalLM, or a PEFT model of one)")


class SparsityLoop:
    """The sparsity side of a Trainer run: the controller, the routers, the step's sums."""

    def __init__(self, model, init_lambda: float | str = "auto") -> None:
        from remoe.method.sparsity import build_controller
        from remoe.train.control import StepControl

        cfg = remoe_config(model)
        c = cfg.control
        if cfg.uses_adaptive_reg and c.revive_after and c.revive_method == "split":
            raise ConfigError("model.revive_method=split needs remoe's own trainer (it copies "
                              "optimizer state); use the hinge with transformers' Trainer")
        if not (init_lambda in ("auto", "config") or (isinstance(init_lambda, (int, float))
                                                      and init_lambda > 0)):
            raise ConfigError(f"init_lambda={init_lambda!r} must be 'auto', 'config' or > 0")
        self.cfg = cfg
        self.routers = token_routers(model)
        self.controller = build_controller(cfg, len(self.routers))
        self.control = StepControl(self.controller, self.routers)
        self.init_lambda = init_lambda
        self.started = self.controller is None or init_lambda == "config"
        self.lambda_rule = "model.lambda0" if init_lambda == "config" else None
        if isinstance(init_lambda, (int, float)) and self.controller is not None:
            self._start([float(init_lambda)], "init_lambda")
        elif init_lambda == "auto" and self.controller is not None:
            from remoe.train.init_lambda import saved_lambda

            where = getattr(cfg, "_name_or_path", "") or ""
            saved = saved_lambda(Path(where), cfg) if where and Path(where).is_dir() else None
            if saved is not None:  # the remoe run that saved the model: its own lambda
                self._start(*saved)
        self.last: dict[str, Any] = {}

    def _start(self, values: list[float], rule: str) -> None:
        self.controller.start(values)
        self.started, self.lambda_rule = True, rule

    def measure(self, model, inputs: dict[str, Any]) -> None:
        """``init_lambda="auto"``: lambda from the gradient balance on this micro-batch (the
        router weights get gradients for the measurement only)."""
        from remoe.train.init_lambda import initial_lambda, pick_lambda

        weights = [r.weight for r in self.routers]
        was = [w.requires_grad for w in weights]
        try:
            for w in weights:
                w.requires_grad_(True)
            batch = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask",
                                                               "labels")}
            with torch.enable_grad():
                lams, info = initial_lambda(model, batch,
                                            self.cfg.control.sparsity_control == "per_layer",
                                            _dist(),
                                            routers=self.routers)
        finally:
            for w, r in zip(weights, was):
                w.requires_grad_(r)
        values, rule = pick_lambda(self.cfg, None, None, lams, info)
        if values:
            self._start(values, rule)
        else:
            self.started, self.lambda_rule = True, rule

    def forward_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A training micro-batch's model inputs with the experts under revival (if any)."""
        revive = self.control.revive_masks()
        return inputs if revive is None else {**inputs, "revive": revive}

    def loss_term(self, out, scale: float) -> torch.Tensor:
        """``(lambda * L_reg + L_aux) * scale`` of one training micro-batch; adds it to the
        step's sums."""
        from remoe.method.sparsity import penalty

        aux = out.aux
        coeff, layer_coeffs = self.control.coeffs()
        reg_L = aux.reg_losses_L if layer_coeffs is not None else None
        extra = penalty(coeff, aux.reg_loss, layer_coeffs, reg_L) + aux.aux_loss
        self.control.add(out)
        return extra * scale

    def step_end(self) -> None:
        """After the optimizer step: the step's one all-reduce, then the routers' and the
        controller's updates (remoe train's sequence)."""
        if not self.control.pending:
            return
        coeff = self.control.coeffs()[0]  # the lambda this step used
        tot = self.control.reduce(None, _dist())  # on the model's device
        stats = self.control.after_step(tot)
        if tot.counts_LN.shape[0]:
            self.last = {"lambda": coeff, "sparsity": stats.sparsity, "reg_loss": tot.reg}

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict() if self.controller else None,
                "lambda_rule": self.lambda_rule}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
        self.started, self.lambda_rule = True, state.get("lambda_rule")


class SparsityCallback(TrainerCallback):
    """Steps the :class:`SparsityLoop` after every optimizer step and saves it in every
    checkpoint (``ReMoETrainerMixin`` adds it)."""

    def __init__(self, loop: SparsityLoop) -> None:
        self.loop = loop

    def on_step_end(self, args, state, control, **kwargs):
        self.loop.step_end()

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(ckpt):
            with open(os.path.join(ckpt, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(self.loop.state_dict(), f)


class ReMoETrainerMixin:
    """Put in front of ``transformers.Trainer`` (or a subclass): ``class T(ReMoETrainerMixin,
    SFTTrainer)``. ``init_lambda``: ``"auto"`` (default), ``"config"`` or a number."""

    def __init__(self, *args: Any, init_lambda: float | str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.remoe = SparsityLoop(self.model, init_lambda)
        self.add_callback(SparsityCallback(self.remoe))

    def _scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Whether the Trainer leaves the loss undivided by the accumulation steps."""
        fixed = getattr(self, "loss_is_scaled_for_ga", None)
        if fixed is not None:
            return bool(fixed)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        training = model.training and torch.is_grad_enabled()
        if training and not self.remoe.started:
            self.remoe.measure(self.accelerator.unwrap_model(model), inputs)
        if training:
            inputs = self.remoe.forward_inputs(inputs)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if training:
            steps = getattr(self, "current_gradient_accumulation_steps",
                            self.args.gradient_accumulation_steps)
            scale = 1.0 / steps if self._scaled_for_accumulation(num_items_in_batch) else 1.0
            loss = loss + self.remoe.loss_term(outputs, scale)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self.remoe.last:
            logs = {**logs, **self.remoe.last}
        return super().log(logs, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The Trainer's save; a remoe model saved whole gets a model card when it brought none
        from the directory it was loaded from (:func:`remoe.rundir.card.ensure_card`)."""
        super()._save(output_dir, state_dict)
        from remoe.model.llama import ReMoEForCausalLM

        d = Path(output_dir if output_dir is not None else self.args.output_dir)
        model = self.accelerator.unwrap_model(self.model)
        if self.args.should_save and isinstance(model, ReMoEForCausalLM) and \
                (d / "config.json").is_file():
            from remoe.rundir.card import ensure_card

            ensure_card(d, model)

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        ckpt = resume_from_checkpoint
        if ckpt is True:
            from transformers.trainer_utils import get_last_checkpoint

            ckpt = get_last_checkpoint(self.args.output_dir)
        if isinstance(ckpt, (str, os.PathLike)):
            path = os.path.join(ckpt, STATE_FILE)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    self.remoe.load_state_dict(json.load(f))
        return super().train(resume_from_checkpoint, *args, **kwargs)


class ReMoETrainer(ReMoETrainerMixin, Trainer):
    """``transformers.Trainer`` with ReMoE's sparsity control (see the module docstring)."""
