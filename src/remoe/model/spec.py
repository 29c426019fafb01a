"""The model config as three sections, each a dataclass validated once (no torch, no transformers).

* :class:`BackboneConfig`: the LLaMA backbone (widths, depth, heads, RoPE, norms, init);
* :class:`RoutingConfig`: the FFN slot: ``router`` (a name of :mod:`remoe.model.registry`), E, k,
  G, the layer's expert options, and ``options``: the dataclass the chosen router declares
  (a built-in's in :mod:`remoe.model.routers.options`, a user's ``register_router(options=)``);
* :class:`SparsityControlConfig`: what the controller (:mod:`remoe.method.sparsity`) reads.

:class:`ModelSpec` composes them: it is the model config. :class:`remoe.ReMoEConfig` (its
transformers serialisation) and the YAML ``model:`` section store it flat (one ``config.json``
key per field, the router's options included). A field is declared once, in its section or its
router's options, with its default and its check. No class here reads through to another:
``spec.routing.options.lb_coeff`` says where a field lives.

Without torch, ``remoe train --print-config`` and config errors stay fast (a router module is
imported only if its class adds checks: :data:`remoe.model.registry.BUILTINS_WITH_CHECKS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from remoe.errors import ConfigError, check
from remoe.model import registry
from remoe.model.checks import (bools, is_int, is_real, nonnegative_reals, one_of,
                                 positive_ints)
from remoe.model.routers.options import LORY_FIRST_SEGMENT, REG_TYPES  # noqa: F401 (public)

#: The built-in values of ``model.router`` (remoe.model.registry; user modules may register more).
#: ``dense`` and ``dense_wide`` replace the MoE layer by a dense SwiGLU FFN of width ``d_ffn``
#: and ``num_experts * d_ffn`` ("Dense x E"); ``lory`` is Lory's segment-merging FFN.
ROUTERS = tuple(registry.BUILTINS)
SPARSITY_CONTROLS = ("global", "per_layer")  # one lambda for the model (paper) | one per layer
LAMBDA_UPDATES = ("sign", "pi")  # eq. 6's sign rule (paper) | proportional-integral in log space
#: what happens to a dead expert: a hinge pulls its router row back | it becomes a copy of the
#: busiest expert of its layer (remoe.train.control.split_expert)
REVIVE_METHODS = ("hinge", "split")
EXPERT_BACKENDS = ("auto", "fused", "grouped_mm", "reference")
#: transformers' generic token ids: model fields too (YAML ``model.eos_token_id``), no section
TOKEN_IDS = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0}

# Table 1 of the paper (dense backbones); the GPT-2 vocabulary 50257 is padded to 50304
# (a multiple of 64), as Megatron does. The two small presets train on a laptop CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "micro": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                  max_position_embeddings=256),
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=8192,
                 max_position_embeddings=512),
    "small": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, vocab_size=50304,
                  max_position_embeddings=1024),
    "medium": dict(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=4,
                   vocab_size=50304, max_position_embeddings=1024),
    "large": dict(hidden_size=1536, num_layers=24, num_heads=16, num_kv_heads=4,
                  vocab_size=50304, max_position_embeddings=1024),
}


@dataclass(frozen=True)
class BackboneConfig:
    """The LLaMA backbone of Table 1 (RMSNorm, RoPE, GQA attention)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA groups
    ffn_hidden_size: int | None = None  # width of the dense FFN; None: 4 x hidden_size
    max_position_embeddings: int = 1024
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    # parts of other model families (remoe convert from-hf), off by default:
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over the whole q and k projections (OLMoE)

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and is_int(self.hidden_size):
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self, p: str = "model.") -> None:
        positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_heads",
                              "num_kv_heads", "ffn_hidden_size", "max_position_embeddings"), p)
        check(self.hidden_size % self.num_heads == 0,
              f"{p}num_heads={self.num_heads} must divide {p}hidden_size={self.hidden_size}")
        check(self.num_heads % self.num_kv_heads == 0,
              f"{p}num_kv_heads={self.num_kv_heads} must divide {p}num_heads={self.num_heads}")
        check(self.head_dim % 2 == 0, f"{p}hidden_size/num_heads={self.head_dim} must be even "
              "(RoPE)")
        check(is_real(self.rope_theta) and self.rope_theta > 0,
              f"{p}rope_theta={self.rope_theta!r} must be > 0")
        check(is_real(self.rms_norm_eps) and self.rms_norm_eps > 0,
              f"{p}rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        check(is_real(self.init_std) and self.init_std > 0,
              f"{p}init_std={self.init_std!r} must be > 0")
        bools(self, ("attention_bias", "qk_norm"), p)


@dataclass(frozen=True)
class RoutingConfig:
    """The FFN slot: which router (or FFN kind), E experts, k, granularity G (E*G experts of
    width d_ffn/G, k*G active), the layer's expert options, and ``options``: the chosen
    router's own options (the dataclass its class declares; read by that router only)."""

    router: str = "relu"
    router_module: str | None = None  # a user module that registers `router` on import
    num_experts: int = 8  # E
    top_k: int = 1  # k (stored as `moe_top_k` in ReMoEConfig / config.json)
    granularity: int = 1  # G
    expert_backend: str = "auto"
    recompute_experts: bool = False
    # a shared SwiGLU expert of this width added to every MoE layer's output (0: none), scaled
    # per token by sigmoid(x w_g) when shared_expert_gate (Qwen2-MoE)
    shared_expert_size: int = 0
    shared_expert_gate: bool = True
    #: the options ``router`` declares (:func:`remoe.model.registry.options_class`): an instance
    #: of its dataclass (None for a router that declares none); None given: its defaults.
    #: Stored flat in config.json and the YAML (``model.lb_coeff``).
    options: Any = dataclasses.field(default=None, metadata={"flat": False})

    def __post_init__(self) -> None:
        if self.options is None:
            cls = user_options_class(self.router, self.router_module)
            if cls is not None:
                object.__setattr__(self, "options", cls())

    @classmethod
    def build(cls, fields: dict[str, Any], strict: bool = True) -> "RoutingConfig":
        """The section from flat fields, the chosen router's options among them (a user
        router's module is imported first). Another built-in router's option (every one was a
        model field, and old config.json files hold them all) is checked, then left out.
        Unknown keys raise ConfigError when ``strict``, else are ignored."""
        own_names = {f.name for f in _flat_fields(cls)}
        own = {k: v for k, v in fields.items() if k in own_names}
        rest = {k: v for k, v in fields.items() if k not in own_names}
        opts_cls = user_options_class(own.get("router", cls.router), own.get("router_module"))
        opts = None
        if opts_cls is not None:
            names = {f.name for f in dataclasses.fields(opts_cls)}
            opts = opts_cls(**{k: rest.pop(k) for k in list(rest) if k in names})
        for other in registry.light_options().values():  # other routers' options
            names = {f.name for f in dataclasses.fields(other)} & set(rest)
            if names:
                other(**{k: rest[k] for k in names}).validate()
        rest = {k: v for k, v in rest.items() if k not in _light_option_names()}
        if strict and rest:
            key = next(iter(rest))
            allowed = [*field_types(own.get("router", cls.router), own.get("router_module"))]
            raise ConfigError(f"unknown key model.{key} (allowed: preset, {', '.join(allowed)})")
        return cls(**own, options=opts)

    def replace(self, **fields: Any) -> "RoutingConfig":
        """A copy with some fields (the router's options included) changed."""
        return RoutingConfig.build({**self.flat(), **fields})

    def flat(self) -> dict[str, Any]:
        """Every field, one level: the section's own, then the router's options."""
        out = {f.name: getattr(self, f.name) for f in _flat_fields(self)}
        if self.options is not None:
            out.update(dataclasses.asdict(self.options))
        return out

    # the derived sizes, each defined here only
    @property
    def num_routed(self) -> int:
        """N = E * G routed experts (each of width d_ffn / G)."""
        return self.num_experts * self.granularity

    @property
    def num_active(self) -> int:
        """k * G: the routed experts a token uses (at the target, for an adaptive router)."""
        return self.top_k * self.granularity

    @property
    def target_density(self) -> float:
        """k/E: the share of experts a token uses on average (G does not change it)."""
        return self.top_k / self.num_experts

    @property
    def target_sparsity(self) -> float:
        """The sparsity ReMoE steers to: 1 - k/E."""
        return 1.0 - self.target_density

    def validate(self, p: str = "model.") -> None:
        """The section's own checks and its options' (the router's cross-field hook runs in
        :meth:`ModelSpec.validate`)."""
        if self.router_module:  # a user's router registers itself on import
            registry.import_modules([self.router_module], f"{p}router_module")
        positive_ints(self, ("num_experts", "top_k", "granularity"), p)
        check(isinstance(self.router, str) and self.router in registry.names(),
              f"{p}router={self.router!r} must be one of {', '.join(registry.names())} (or a "
              "router registered by the module named in model.router_module)")
        one_of(self, "expert_backend", EXPERT_BACKENDS, p)
        check(self.top_k <= self.num_experts,
              f"{p}top_k={self.top_k} must be <= {p}num_experts={self.num_experts}")
        bools(self, ("shared_expert_gate",), p)
        v = self.shared_expert_size
        check(is_int(v) and v >= 0,
              f"{p}shared_expert_size={v!r} must be an integer >= 0 (0: no shared expert)")
        check(v == 0 or registry.is_token_router(self.router),
              f"{p}shared_expert_size={v} needs a token router (an MoE layer), not "
              f"{p}router={self.router!r}")
        opts_cls = registry.options_class(self.router)
        check(type(self.options) is (opts_cls or type(None)),
              f"{p}router={self.router!r} takes options {getattr(opts_cls, '__name__', None)}, "
              f"not {type(self.options).__name__}")
        if self.options is not None:
            _check_options(self.options, p)


@dataclass(frozen=True)
class SparsityControlConfig:
    """The adaptive lambda of eq. 6 and its options; read by the controller, not the model
    (used only when the router declares ``uses_adaptive_reg``)."""

    lambda0: float = 1e-8
    alpha: float = 1.2
    sparsity_control: str = "global"  # one lambda for the model (paper) | "per_layer"
    lambda_update: str = "sign"  # eq. 6's sign rule (paper) | "pi"
    lambda_pi_kp: float = 1.0
    # ki = 1 measured best (docs/CONTROL.md): 0.25 left a layer 0.15 under target after 300 steps
    lambda_pi_ki: float = 1.0
    # lambda never falls below this (0: no floor, the paper); per-layer, a layer sparser than
    # its target drove its lambda to 1e-30 and back up over hundreds of steps
    lambda_floor: float = 0.0
    revive_after: int = 0  # hand experts starving this many steps to the revival hinge (0: off)
    # an expert starves in a step when it gets at most this share of the step's tokens
    # (0: only an expert with no token; 1/64: paper Fig. 7's "inactive")
    revive_below: float = 0.0
    # once revived, an expert stays under revival until it gets at least this share of a step's
    # tokens (0: until it is above revive_below again; k/E: back at its fair share)
    revive_until: float = 0.0
    # hinge: the revival hinge pulls a dead expert's router row back toward its nearest tokens;
    # split: one dead expert per layer and step becomes a copy of the busiest live expert
    revive_method: str = "hinge"

    def validate(self, p: str = "model.") -> None:
        check(is_real(self.alpha) and self.alpha > 1.0,
              f"{p}alpha={self.alpha!r} must be a finite number > 1")
        check(is_real(self.lambda0) and self.lambda0 > 0,
              f"{p}lambda0={self.lambda0!r} must be a positive finite number")
        one_of(self, "sparsity_control", SPARSITY_CONTROLS, p)
        one_of(self, "lambda_update", LAMBDA_UPDATES, p)
        one_of(self, "revive_method", REVIVE_METHODS, p)
        nonnegative_reals(self, ("lambda_pi_kp", "lambda_pi_ki", "lambda_floor"), p)
        check(is_int(self.revive_after) and self.revive_after >= 0,
              f"{p}revive_after={self.revive_after!r} must be an integer >= 0 (0: off)")
        check(is_real(self.revive_below) and 0.0 <= self.revive_below < 1.0,
              f"{p}revive_below={self.revive_below!r} must be a number in [0, 1) (a share of "
              "the step's tokens)")
        check(is_real(self.revive_until)
              and (self.revive_until == 0.0 or self.revive_below < self.revive_until < 1.0),
              f"{p}revive_until={self.revive_until!r} must be 0 (off) or a share of the step's "
              f"tokens in (revive_below={self.revive_below!r}, 1)")


SECTIONS = {"backbone": BackboneConfig, "routing": RoutingConfig, "control": SparsityControlConfig}


def _flat_fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if f.metadata.get("flat", True)]


def section_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every flat model field -> (its section, its dataclass field), in documentation order
    (a user router's options are not among them: :func:`field_types`)."""
    return {f.name: (name, f) for name, cls in SECTIONS.items() for f in _flat_fields(cls)}


def user_options_class(router: Any, router_module: Any = None) -> type | None:
    """The options dataclass ``router`` declares, a built-in's or a user router's (imported
    from ``router_module`` if needed); None for a router that declares none and for a name
    nobody registered (validation names that one). A user router's option may not reuse the
    name of a section field."""
    if not isinstance(router, str):
        return None
    if router_module and router not in registry.names():
        registry.import_modules([router_module], "model.router_module")
    if router not in registry.names():
        return None
    opts = registry.options_class(router)
    if opts is not None and router not in registry.BUILTINS:
        taken = set(section_fields()) | set(TOKEN_IDS) | {"preset", "moe_top_k"}
        clash = [f.name for f in dataclasses.fields(opts) if f.name in taken]
        check(not clash, f"model.router={router!r} declares option {clash[0] if clash else ''!r}, "
              "which is already a model field: rename the option")
    return opts


def _light_option_names() -> set[str]:
    return {f.name for c in registry.light_options().values() for f in dataclasses.fields(c)}


def field_home(name: str) -> str | None:
    """Where the flat model key ``name`` lives in a spec (``routing.num_experts``,
    ``routing.options.lb_coeff``, ``routing.top_k`` for ``moe_top_k``); None: no model field
    (a user router's option is found through its ``routing.options``)."""
    if name == "moe_top_k":
        return "routing.top_k"
    if name in section_fields():
        return f"{section_fields()[name][0]}.{name}"
    return f"routing.options.{name}" if name in _light_option_names() else None


def field_types(router: Any = "relu", router_module: Any = None) -> dict[str, str]:
    """Every flat model key -> its annotation: the sections' fields, every built-in router's
    options (keys of the YAML and of old config.json files whichever router is chosen), the
    options of ``router`` (a user router's, imported from ``router_module`` if needed) and the
    token ids."""
    out = {name: str(f.type) for name, (_, f) in section_fields().items()}
    for c in registry.light_options().values():
        out.update({f.name: _annotation(f) for f in dataclasses.fields(c)})
    opts = user_options_class(router, router_module)
    if opts is not None:
        out.update({f.name: _annotation(f) for f in dataclasses.fields(opts)})
    return {**out, **{name: "int" for name in TOKEN_IDS}}


def _annotation(f: dataclasses.Field) -> str:
    """A field's annotation as text (``float``, ``int | None``): a string under
    ``from __future__ import annotations``, a class or a union otherwise."""
    t = f.type
    return t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)


_OPTION_TYPES = {"int": is_int, "float": is_real, "bool": lambda v: isinstance(v, bool),
                 "str": lambda v: isinstance(v, str)}


def _check_options(opts: Any, p: str) -> None:
    """A router's options: each value of its declared type (the options of
    ``remoe.model.routers.options`` check their own), then the class's own
    ``validate(prefix)`` if it has one (ConfigError naming the field either way)."""
    light = type(opts) in registry.light_options().values()
    for f in ([] if light else dataclasses.fields(opts)):
        v, t = getattr(opts, f.name), _annotation(f).replace(" ", "")
        if v is None and t.endswith("|None"):
            continue
        ok = _OPTION_TYPES.get(t.removesuffix("|None"))
        check(ok is None or ok(v), f"{p}{f.name}={v!r} must be of type {t} (an option of "
              f"{p}router's module)")
    if callable(getattr(opts, "validate", None)):
        opts.validate(p)


def defaults() -> dict[str, Any]:
    """Every model key's default, the built-in routers' options included
    (``ffn_hidden_size`` None: 4 x hidden_size)."""
    out = {name: f.default for name, (_, f) in section_fields().items()}
    for c in registry.light_options().values():
        out.update({f.name: f.default for f in dataclasses.fields(c)})
    return {**out, **TOKEN_IDS}


@dataclass(frozen=True)
class ModelSpec:
    """The model config, composed: ``backbone``, ``routing`` (with the router's ``options``),
    ``control``. Read a field through its section (``spec.routing.num_experts``)."""

    backbone: BackboneConfig = dataclasses.field(default_factory=BackboneConfig)
    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
    control: SparsityControlConfig = dataclasses.field(default_factory=SparsityControlConfig)

    @classmethod
    def from_flat(cls, fields: dict[str, Any], strict: bool = True) -> "ModelSpec":
        """Split flat fields over the sections (``preset`` expands first; ``moe_top_k`` is
        ``top_k``). Unknown keys raise ConfigError when ``strict``, else are ignored."""
        fields = dict(fields)
        preset = fields.pop("preset", None)
        if preset is not None:
            check(preset in PRESETS, f"model.preset={preset!r} must be one of {sorted(PRESETS)}")
            fields = {**PRESETS[preset], **fields}
        if "moe_top_k" in fields:  # ReMoEConfig's / config.json's name for k
            k = fields.pop("moe_top_k")
            fields["top_k"] = k if fields.get("top_k") is None else fields["top_k"]
        if "top_k" in fields and fields["top_k"] is None:  # None: the default k
            fields["top_k"] = 1
        known = section_fields()
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in fields.items():
            if key in known:
                parts[known[key][0]][key] = value
            elif key not in TOKEN_IDS:  # a user router's option, or unknown: build() decides
                parts["routing"][key] = value
        return cls(backbone=BackboneConfig(**parts["backbone"]),
                   routing=RoutingConfig.build(parts["routing"], strict),
                   control=SparsityControlConfig(**parts["control"]))

    def flat(self) -> dict[str, Any]:
        """Every field of every section, one level (the YAML/config.json spelling but top_k),
        a user router's options included."""
        out = dataclasses.asdict(self.backbone)
        out.update(self.routing.flat())
        out.update(dataclasses.asdict(self.control))
        return out

    @property
    def target_sparsity(self) -> float:
        return self.routing.target_sparsity

    def validate(self, p: str = "model.") -> None:
        """Each section's checks, then the cross-section ones and the router's own hook
        (``validate_config(spec, prefix)``: it reads ``spec.routing``, ``spec.control``, ...)."""
        self.backbone.validate(p)
        self.routing.validate(p)
        g, ffn = self.routing.granularity, self.backbone.ffn_hidden_size
        check(ffn % g == 0, f"{p}granularity={g} must divide {p}ffn_hidden_size={ffn}")
        registry.validate_config(self.routing.router, self, p)
        self.control.validate(p)
