"""``ReMoEConfig``: the transformers serialisation of the model config.

The model config is :class:`remoe.model.spec.ModelSpec` (backbone, routing with the router's
options, sparsity control): every field, its default and its check live there or in the
router's options dataclass. ``ReMoEConfig`` holds one, validated when it is made
(``config.spec``; ``config.backbone``/``config.routing``/``config.control`` are its sections),
and is flat only where others read it flat: ``to_dict``/``from_dict`` (``config.json``, one key
per field, the same keys as always: old files load unchanged, those that stored every router's
options included) and the few backbone names transformers' own code reads (``vocab_size``,
``hidden_size``, ``num_hidden_layers``, ...). Any other model field read flat
(``config.num_experts``) raises one line naming its section.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from remoe.model import registry
from remoe.model.spec import (EXPERT_BACKENDS, LAMBDA_UPDATES, LORY_FIRST_SEGMENT, PRESETS,
                              REG_TYPES, ROUTERS, SPARSITY_CONTROLS, TOKEN_IDS, BackboneConfig,
                              ModelSpec, RoutingConfig, SparsityControlConfig, defaults,
                              field_home, field_types)

__all__ = ["EXPERT_BACKENDS", "LAMBDA_UPDATES", "LORY_FIRST_SEGMENT", "PRESETS", "REG_TYPES",
           "ROUTERS", "SPARSITY_CONTROLS", "ModelSpec", "ReMoEConfig"]

#: the backbone fields transformers' own code reads on a config (generation, caches, PEFT):
#: its name -> the field of :class:`~remoe.model.spec.BackboneConfig`
HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
            "max_position_embeddings": "max_position_embeddings",
            "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim"}


def _attr(field: str) -> str:
    # k is stored as `moe_top_k`: transformers treats any config attribute named `top_k` as a
    # sampling setting. `top_k=` is accepted as the constructor's name for it.
    return "moe_top_k" if field == "top_k" else field


def _record_router_module(spec: ModelSpec) -> ModelSpec:
    """A router registered by a user module, with that module recorded (in config.json too), so
    that the saved model loads wherever the module is importable (validation imports it)."""
    r = spec.routing
    if not r.router_module and isinstance(r.router, str) and r.router not in registry.BUILTINS \
            and r.router in registry.names():
        return dataclasses.replace(spec, routing=dataclasses.replace(
            r, router_module=registry.resolve(r.router).__module__))
    return spec


def _model_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Pop the model fields (flat, as in config.json) out of ``fields``."""
    if fields.get("expert_backend") == "measured":  # a removed opt-in backend: a saved
        fields["expert_backend"] = "auto"  # config.json that names it computes as auto
    names = field_types(fields.get("router", RoutingConfig.router), fields.get("router_module"))
    return {k: fields.pop(k) for k in list(fields)
            if k in names and k not in TOKEN_IDS or k in ("moe_top_k", "preset")}


class ReMoEConfig(PretrainedConfig):
    """Configuration of :class:`remoe.ReMoEForCausalLM`: a :class:`~remoe.model.spec.ModelSpec`.

    Takes every field of :class:`~remoe.model.spec.BackboneConfig` (``hidden_size``,
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``ffn_hidden_size`` = 4 x hidden by
    default, ...), :class:`~remoe.model.spec.RoutingConfig` (``router``, ``num_experts`` E,
    ``top_k`` k, ``granularity`` G, the router's options) and
    :class:`~remoe.model.spec.SparsityControlConfig` (``lambda0``, ``alpha``, ...) as keyword
    arguments, plus transformers' own (token ids, ``tie_word_embeddings``, ...); or a spec
    (:meth:`from_spec`). Read a field through its section: ``config.routing.num_experts``.
    """

    model_type = "remoe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache field, < 5.24 / 5.24 on

    def __init__(self, **kwargs: Any) -> None:
        spec = kwargs.pop("_validated_spec", None)  # from_spec: validated by its caller
        if spec is None:  # from the flat fields (a user's keywords, a saved config.json)
            spec = _record_router_module(ModelSpec.from_flat(_model_fields(kwargs)))
            spec.validate()  # this path's one validation (a model build never re-checks it)
        else:
            spec = _record_router_module(spec)
        self.spec = spec
        for name, default in TOKEN_IDS.items():
            kwargs.setdefault(name, default)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @classmethod
    def from_spec(cls, spec: ModelSpec, **kwargs: Any) -> "ReMoEConfig":
        """The serialisation of a model config that its caller has validated
        (:func:`remoe.experiment.load_config` validates the experiment's): not checked again.
        ``kwargs``: transformers' own (token ids, ``tie_word_embeddings``, ...), no model field."""
        clash = sorted(set(kwargs) & (set(spec.flat()) | {"moe_top_k", "preset"}))
        if clash:
            raise TypeError(f"ReMoEConfig.from_spec: {clash[0]!r} is a model field; set it in "
                            "the spec")
        return cls(_validated_spec=spec, **kwargs)

    # the sections of the spec
    @property
    def backbone(self) -> BackboneConfig:
        return self.spec.backbone

    @property
    def routing(self) -> RoutingConfig:
        return self.spec.routing

    @property
    def control(self) -> SparsityControlConfig:
        return self.spec.control

    @property
    def is_moe(self) -> bool:
        return bool(registry.declares(self.spec.routing.router, "is_moe"))

    @property
    def uses_adaptive_reg(self) -> bool:
        """The router's reg_loss is scaled by the adaptive lambda (ReLU)."""
        return bool(registry.declares(self.spec.routing.router, "uses_adaptive_reg"))

    def __getattr__(self, name: str) -> Any:
        # only raises (reached when normal lookup fails): a model field read flat names its home
        opts = getattr(self.__dict__.get("spec"), "routing", None)
        home = field_home(name) or (f"routing.{name}" if isinstance(
            getattr(RoutingConfig, name, None), property) else None) or (  # a derived size
            f"routing.options.{name}" if hasattr(getattr(opts, "options", None), name) else None)
        raise AttributeError(f"ReMoEConfig has no {name!r}: read config.{home}" if home else
                             f"'ReMoEConfig' object has no attribute {name!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        # (``top_k``: transformers < 5 sets its own sampling default; k is ``moe_top_k``)
        if key not in HF_NAMES and key != "top_k" and field_home(key):
            raise AttributeError(f"ReMoEConfig.{key} is not set flat: make a new config "
                                 "(ReMoEConfig.from_spec(spec), or its keywords)")
        super().__setattr__(key, value)

    def to_dict(self) -> dict[str, Any]:
        """As transformers', with the spec flat (config.json: one key per field)."""
        out = super().to_dict()
        out.pop("spec", None)
        out.update({_attr(k): v for k, v in self.spec.flat().items()})
        return out

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "ReMoEConfig":
        """As transformers', with model-field overrides (``from_pretrained(d, num_experts=16)``;
        ``top_k=`` is ``moe_top_k``) applied to the flat fields before the spec is made."""
        if "top_k" in kwargs:
            kwargs["moe_top_k"] = kwargs.pop("top_k")
        over = _model_fields(kwargs) if kwargs else {}
        return super().from_dict({**config_dict, **over} if over else config_dict, **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ReMoEConfig":
        return cls(preset=name, **overrides)  # the spec expands it (ModelSpec.from_flat)

    def moe_config(self):
        """The MoE layer's config (:meth:`remoe.model.moe.MoEConfig.of`)."""
        from remoe.model.moe import MoEConfig

        return MoEConfig.of(self.spec)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line naming the field) on an impossible config
        (the constructor has validated what it was given; :meth:`from_spec` trusts its caller)."""
        self.spec.validate()


def _hf_view(field: str) -> property:
    def get(self: ReMoEConfig) -> Any:
        return getattr(self.spec.backbone, field)

    def put(self: ReMoEConfig, value: Any) -> None:  # transformers' resize_token_embeddings
        b = dataclasses.replace(self.spec.backbone, **{field: value})
        self.spec = dataclasses.replace(self.spec, backbone=b)
    return property(get, put if field == "vocab_size" else None,
                    doc=f"``spec.backbone.{field}`` (read by transformers)")


for _name, _field in HF_NAMES.items():
    setattr(ReMoEConfig, _name, _hf_view(_field))

if __name__.split(".")[0] == "remoe":  # the package (not a copy bundled by remoe.model.bundle)
    AutoConfig.register("remoe", ReMoEConfig, exist_ok=True)

# the constructor's keywords, for help() and inspect.signature (read by a few tools)
ReMoEConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in defaults().items()]
    + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
