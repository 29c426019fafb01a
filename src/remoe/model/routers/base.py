"""The router interface shared by every routing method.

Legend: T tokens, D model width, N routed experts (E*G).

A router maps token states ``x_TD`` to a :class:`Routing`: per-token gates ``gates_TN`` (zero
where inactive), the boolean active mask ``mask_TN`` and its auxiliary losses. Dispatch and the
experts only ever see a Routing, never the router that produced it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class RouterContext:
    """What a router may need besides the token states.

    ``token_ids_T`` (hash routing), ``batch_size``/``seq_len`` (segment or sequence-level
    routers), ``step`` (the optimizer step in training; ``None`` at inference: schedules such as
    the TopK warm-up then use their final value), ``record_masks`` (return each layer's mask),
    ``past_len`` (cached positions before this call's tokens; 0 for a full forward),
    ``pad_left`` (each sequence's left padding in a padded batch, or None), ``revive_N`` (in
    training: this layer's experts under revival, bool ``[N]``, or None; the model's
    ``revive=`` argument, from the sparsity control), ``capacity`` (see the field).
    """

    batch_size: int
    seq_len: int
    token_ids_T: Tensor | None = None
    step: int | None = None
    record_masks: bool = False
    past_len: int = 0  # positions already in the KV cache (Lory continues its segment there)
    #: left-padding count of each sequence (batched generation), None without padding (Lory
    #: starts its segments after the padding; token-wise routers ignore it)
    pad_left: list[int] | None = None
    #: experts whose revival hinge is on in this forward (a training input; None: none)
    revive_N: Tensor | None = None
    #: pairs the on-device dispatch plan of a data-dependent router holds in this forward (a
    #: bound from the previous step's counts; pairs past it are cut and the layer reports an
    #: overflow, so the caller redoes the step). None: the layer's plan (exact or static)
    capacity: int | None = None


@dataclass
class Routing:
    gates_TN: Tensor  # float: the weight of each expert's output, 0 where inactive
    mask_TN: Tensor  # bool: active (token, expert) pairs
    reg_loss: Tensor  # scalar: the term multiplied by the adaptive lambda (ReLU); 0 otherwise
    aux_loss: Tensor  # scalar: auxiliary loss already multiplied by its fixed coefficient
    #: active pairs (``mask_TN.sum()``) when the router knows it without looking at the data
    #: (fixed-k routers: T*k); lets dispatch stay on the device (no host sync). None: unknown
    num_pairs: int | None = None
    #: a bound on the active pairs known on the host when ``num_pairs`` is not (ReLU with
    #: ``max_active``: T*max_active); None: T*N. Sizes the padded, sync-free device plan
    max_pairs: int | None = None


class Router(nn.Module):
    """Base class: subclasses implement :meth:`forward` ``(x_TD, ctx) -> Routing``."""

    # Declarations read by the rest of remoe through remoe.model.registry (never by name):
    #: the MoE layer routes tokens to experts (FFN kinds such as dense say False)
    is_moe: bool = True
    #: ``reg_loss`` must be scaled by the adaptive lambda controller (ReLU)
    uses_adaptive_reg: bool = False
    #: a learned [N, D] router: 2*D*N FLOPs per token and layer
    has_router_weights: bool = True
    #: train.expert_parallel can shard the experts of a layer with this router
    expert_parallel: bool = True
    #: every parameter gets a gradient in every step (False: DDP looks for unused ones)
    uses_all_params: bool = True
    #: the dataclass of this router's own options (``remoe.model.routers.options``; a user
    #: router's: ``register_router(options=...)``); None: it has none
    options: type | None = None

    @classmethod
    def from_config(cls, cfg) -> "Router":
        """Build from a :class:`remoe.model.moe.MoEConfig` (each router maps its own fields)."""
        raise NotImplementedError(f"{cls.__name__}.from_config")

    @classmethod
    def validate_config(cls, cfg, prefix: str = "model.") -> None:
        """Extra config checks of this router (ConfigError naming the field); none by default."""

    @classmethod
    def expected_pairs(cls, cfg, step: int | None, dense_steps: int = 0) -> float:
        """(token, expert) pairs per token and layer this router is expected to route at
        optimizer step ``step`` (None: after every warm-up), for cost estimates made before a
        run (``remoe study --dry-run``). ``cfg``: the routing section; ``dense_steps``: the
        estimated length of stage I for routers under the adaptive lambda. Default: k*G."""
        return float(cfg.num_active)

    @classmethod
    def effective_pairs(cls, cfg, counted_pairs: float, tokens: int) -> float:
        """(token, expert) pairs that cost an expert computation, from the counted ones."""
        return counted_pairs

    def __init__(self, d_model: int, num_experts: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.d_model, self.num_experts = d_model, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))  # W^T: [N, D]
        nn.init.normal_(self.weight, std=init_std)

    def logits(self, x_TD: Tensor) -> Tensor:
        """``x W`` in at least fp32 whatever the autocast dtype (routing decisions are precision-sensitive)."""
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            dt = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 or wider (fp64 tests)
            return x_TD.to(dt) @ self.weight.to(dt).t()

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:  # pragma: no cover
        raise NotImplementedError

    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        """The one post-step hook: the trainer calls it once after every optimizer step with
        this layer's tokens per expert in that step (``[N]``) and the step's token count
        ``num_tokens``, both summed over micro-batches and data-parallel ranks (so every rank
        sees the same values; ``num_tokens`` None where the caller does not know it). For
        routers with non-gradient state (the expert bias of ``topk_auxfree``, the thresholds);
        nothing by default. A subclass that overrides it with the older one-argument
        ``after_step(self, counts_N)`` is adapted when its class is made (the count dropped)."""

    def discard_step(self) -> None:
        """Forget what this step's training forwards accumulated for :meth:`after_step`: the
        trainer redoes the step (``train.dispatch_plan=capacity`` after an overflow), so its
        forwards run again. Nothing by default (a router that keeps no per-step sums)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hook = cls.__dict__.get("after_step")
        if callable(hook) and not _takes_num_tokens(hook):
            cls.after_step = _counts_only(hook)


def _takes_num_tokens(hook) -> bool:
    """Whether ``hook(self, counts_N, num_tokens)`` binds (an unreadable signature: assumed)."""
    try:
        inspect.signature(hook).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _counts_only(hook):
    """``after_step(self, counts_N, num_tokens=None)`` calling a one-argument ``hook``."""

    def after_step(self, counts_N: Tensor, num_tokens: float | None = None) -> None:
        return hook(self, counts_N)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(after_step, name, getattr(hook, name, None))
    return after_step


def zero(x: Tensor) -> Tensor:
    return x.new_zeros((), dtype=torch.float32)


def bias_update(load_N: Tensor, rate: float) -> Tensor:
    """The centred sign step: ``+rate`` for under-loaded experts, ``-rate`` for over-loaded ones,
    minus its mean (so the biases keep summing to what they summed to before)."""
    load_N = load_N.to(torch.float64)
    delta_N = rate * torch.sign(load_N.mean() - load_N)
    return delta_N - delta_N.mean()

