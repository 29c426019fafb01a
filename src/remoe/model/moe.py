"""The MoE layer: router -> dispatch -> experts -> combine.  It knows no router by name.

Legend: T tokens, D model width, N experts (E*G), H expert width (d_ffn/G), P active pairs.

``MoELayer`` is usable on its own, as a drop-in FFN replacement::

    layer = MoELayer(MoEConfig.build(d_model=512, d_ffn=2048, num_experts=8, top_k=1))
    y, aux = layer(x)            # x: [..., D] -> y: [..., D]; aux: LayerAux

A token whose router activates no expert gets exact zeros (only the residual carries it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from remoe.model import dispatch
from remoe.model.experts import SwiGLU, SwiGLUExperts
from remoe.model.routers.base import Router, RouterContext
from remoe.model.shared_expert import build_shared_expert
from remoe.model.spec import RoutingConfig, field_home


@dataclass(frozen=True)
class MoEConfig:
    """One FFN slot's view of the model config: the backbone's widths and init, and the routing
    section (router, E, k, G, the router's ``options``, the derived ``num_routed`` = E*G and
    ``target_density`` = k/E), declared and computed there only. A model build makes one
    (:meth:`of`) and hands it to every layer. From keywords:
    ``MoEConfig.build(d_model=512, d_ffn=2048, num_experts=8, top_k=1)``."""

    d_model: int
    d_ffn: int  # the width of the dense FFN an expert replaces (each expert: d_ffn / G)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    init_std: float = 0.02

    @classmethod
    def of(cls, spec) -> "MoEConfig":
        """The slot of a :class:`~remoe.model.spec.ModelSpec`: its backbone widths and init, its
        routing section."""
        b = spec.backbone
        return cls(b.hidden_size, b.ffn_hidden_size, spec.routing, b.init_std)

    @classmethod
    def build(cls, d_model: int, d_ffn: int, init_std: float = 0.02,
              routing: RoutingConfig | None = None, **routing_fields) -> "MoEConfig":
        """From the widths and flat routing fields (``num_experts=8, lb_coeff=0.1``; names as
        in the YAML), or a section with some of its fields changed."""
        if routing is None:
            routing = RoutingConfig.build(routing_fields)
        elif routing_fields:
            routing = routing.replace(**routing_fields)
        return cls(d_model, d_ffn, routing, init_std)

    @property
    def options(self):
        """The router's own options (:attr:`RoutingConfig.options`)."""
        return self.routing.options

    @property
    def num_routed(self) -> int:
        """N = E * G routed experts (:attr:`RoutingConfig.num_routed`)."""
        return self.routing.num_routed

    @property
    def d_expert(self) -> int:
        """Each routed expert's width: d_ffn / G."""
        return self.d_ffn // self.routing.granularity

    @property
    def target_density(self) -> float:
        """k/E (:attr:`RoutingConfig.target_density`)."""
        return self.routing.target_density

    def __getattr__(self, name: str):
        # only raises (reached when normal lookup fails): a field read flat names its home
        home = _LAYER_NAMES.get(name) or (field_home(name) or "").replace("routing.options.",
                                                                          "options.")
        if home.startswith(("backbone.", "control.")):
            home = ""  # not the layer's: the model reads them (spec.backbone, spec.control)
        elif not home and isinstance(getattr(RoutingConfig, name, None), property):  # derived
            home = f"routing.{name}"
        raise AttributeError(f"MoEConfig has no {name!r}: read cfg.{home}" if home else
                             f"'MoEConfig' object has no attribute {name!r}")


#: the backbone's names for the layer's own fields
_LAYER_NAMES = {"hidden_size": "d_model", "ffn_hidden_size": "d_ffn"}


def build_router(cfg, cls: type | None = None) -> Router:
    """Build the token router of ``cfg`` (a :class:`remoe.model.moe.MoEConfig`): ``cls``, the
    class its model build resolved once, or ``cfg.routing.router`` through
    :mod:`remoe.model.registry` (built-ins and routers registered by user modules alike)."""
    from remoe.model import registry

    cls = cls or registry.resolve(cfg.routing.router)
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise ValueError(f"model.router={cfg.routing.router!r} is an FFN kind, not a token router")
    return cls.from_config(cfg)


@dataclass
class LayerAux:
    """What one FFN slot reports besides its output (tensors: no host sync in forward)."""

    reg_loss: Tensor  # scalar: this layer's L_reg term (scaled by lambda outside)
    aux_loss: Tensor  # scalar: fixed-weight auxiliary loss
    active_counts_N: Tensor  # float [N]: tokens routed to each expert ([0] for dense FFNs)
    num_tokens: int
    mask_TN: Tensor | None = None  # bool [T, N] when ctx.record_masks
    #: 0-d float, 1 when ``ctx.capacity`` cut the plan's pairs (the output is not exact); None
    #: when the layer ran without a capacity
    overflow: Tensor | None = None


def _context_for(x: Tensor, ctx: RouterContext | None) -> RouterContext:
    if ctx is not None:
        return ctx
    lead = x.shape[:-1]
    B = lead[0] if len(lead) > 1 else 1
    return RouterContext(batch_size=B, seq_len=x[..., 0].numel() // max(B, 1))


def base_experts(experts: nn.Module) -> nn.Module:
    """The :class:`SwiGLUExperts` inside wrappers such as PEFT's (``get_base_layer``)."""
    while not isinstance(experts, SwiGLUExperts) and hasattr(experts, "get_base_layer"):
        experts = experts.get_base_layer()
    return experts


class MoELayer(nn.Module):
    """Token-routed experts: any :class:`~remoe.model.routers.Router`, dropless dispatch."""

    #: data-dependent routing on the device path: False = the exact plan (``nonzero``: one host
    #: sync per call), True = a plan padded to a static capacity (no sync, shapes fixed by T;
    #: the padding rows cost work and memory: 0.61x the exact plan's tokens/s on an H200,
    #: docs/SCALING.md). Set by ``train.dispatch_plan`` (remoe.train.runtime.set_dispatch_plan).
    #: A ``capacity`` in the router context (``train.dispatch_plan=capacity``) overrides both.
    static_plan: bool = False

    def __init__(self, cfg: MoEConfig, router_cls: type | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = build_router(cfg, router_cls)
        r = cfg.routing
        self.experts = SwiGLUExperts(cfg.num_routed, cfg.d_model, cfg.d_expert, cfg.init_std,
                                     backend=r.expert_backend, recompute=r.recompute_experts)
        self.shared_expert = build_shared_expert(cfg)  # None unless cfg.shared_expert_size > 0

    def forward(self, x: Tensor, ctx: RouterContext | None = None) -> tuple[Tensor, LayerAux]:
        ctx = _context_for(x, ctx)
        x_TD = x.reshape(-1, x.shape[-1])
        T = x_TD.shape[0]
        r = self.router(x_TD, ctx)
        # grouped_mm (the CUDA backend) keeps the plan on the device with no host sync: exact
        # for fixed-k routers, padded to a static capacity for data-dependent ones (see
        # static_plan; exact: nonzero, one sync); the CPU backends plan on the host
        base = base_experts(self.experts)
        on_device = x_TD.device.type != "cpu" or base.resolve_backend(x_TD) == "grouped_mm"
        capacity = None
        if on_device and r.num_pairs is None and base.accepts_padded_plan:
            full = r.max_pairs if r.max_pairs is not None else r.mask_TN.numel()
            if ctx.capacity is not None:  # a bound from the previous step (CapacityPlan)
                # the builtin min: dynamo traces it on symbolic ints in every torch we met;
                # torch.sym_min of two ints broke the block's graph under torch 2.11 (an op
                # returning a non-tensor), 2 breaks per model on the H200 (docs/GPU.md)
                capacity = min(ctx.capacity, full)
            elif self.static_plan:
                capacity = full
        plan = dispatch.plan(r.mask_TN, r.num_pairs, on_device=on_device, capacity=capacity)
        # gather -> experts -> gate -> scatter-add (fused on CPU: no [P, D] copies)
        if isinstance(self.experts, SwiGLUExperts):
            y_TD = self.experts.forward_tokens(x_TD, r.gates_TN, plan)
        else:  # wrapped (PEFT's ParamWrapper on w_in/w_out): its call applies the adapter
            y_TD = self.experts(x_TD, gates_TN=r.gates_TN, plan=plan)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        aux = LayerAux(r.reg_loss, r.aux_loss, plan.counts_N.float(), T,
                       r.mask_TN if ctx.record_masks else None,
                       None if ctx.capacity is None else
                       plan.overflow if plan.overflow is not None else r.reg_loss.new_zeros(()))
        return y_TD.view_as(x), aux


class DenseFFN(nn.Module):
    """Dense SwiGLU in the same slot (``dense``: width d_ffn; ``dense_wide``: E x d_ffn)."""

    # declarations read through remoe.model.registry (see remoe.model.routers.base.Router)
    is_moe = False
    uses_adaptive_reg = False
    has_router_weights = False
    expert_parallel = False
    uses_all_params = True

    @classmethod
    def width(cls, cfg) -> int:
        """Hidden width of the dense FFN (``cfg`` a MoEConfig or a ModelSpec)."""
        # (by attribute, not isinstance: a saved model's bundled copy of this module may be
        # loaded twice by transformers, each with its own MoEConfig class)
        return cfg.d_ffn if hasattr(cfg, "d_ffn") else cfg.backbone.ffn_hidden_size

    @classmethod
    def from_config(cls, cfg: MoEConfig) -> "DenseFFN":
        return cls(cfg)

    @classmethod
    def validate_config(cls, cfg, prefix: str = "model.") -> None:
        pass

    @classmethod
    def effective_pairs(cls, cfg, counted_pairs: float, tokens: int) -> float:
        return 0.0

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ffn = SwiGLU(cfg.d_model, self.width(cfg), cfg.init_std)

    def forward(self, x: Tensor, ctx: RouterContext | None = None) -> tuple[Tensor, LayerAux]:
        z = x.new_zeros((), dtype=torch.float32)
        T = x[..., 0].numel()
        return self.ffn(x), LayerAux(z, z, x.new_zeros(0, dtype=torch.float32), T)


class DenseWideFFN(DenseFFN):
    """``dense_wide``: a dense SwiGLU E times as wide ("Dense x E", the paper's upper bound)."""

    @classmethod
    def width(cls, cfg) -> int:
        return super().width(cfg) * cfg.routing.num_experts


def build_ffn(cfg: MoEConfig, cls: type | None = None) -> nn.Module:
    """The FFN slot named by ``cfg.routing.router``: ``cls``, the class a model build resolved
    once (:mod:`remoe.model.registry`), or resolved here. A token router goes into an
    :class:`MoELayer`, an FFN kind (dense, dense_wide, lory, ...) is the slot itself. Every
    kind returns ``(y, LayerAux)``."""
    from remoe.model import registry

    cls = cls or registry.resolve(cfg.routing.router)
    if issubclass(cls, Router):
        return MoELayer(cfg, cls)
    return cls.from_config(cfg)
