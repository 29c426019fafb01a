"""``ReMoEConfig``: the transformers serialisation of the model config.

The model config is :class:`remoe.model.spec.ModelSpec` (backbone, routing with the router's
options, sparsity control): every field, its default and its check live there or in the
router's options dataclass. ``ReMoEConfig`` stores it flat, one attribute per field, so that it
serialises as a Hugging Face ``config.json`` with the same keys as always (old ``config.json``
files load unchanged, those that stored every router's options included); ``cfg.spec``
deserialises it (the attributes as they are now), ``cfg.backbone``/``cfg.routing``/
``cfg.control`` are its sections. The MoE layer's config (:class:`remoe.model.moe.MoEConfig`,
:meth:`ReMoEConfig.moe_config`) is built from it once per model build.
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
                              field_types, section_fields, user_options_class)

__all__ = ["EXPERT_BACKENDS", "LAMBDA_UPDATES", "LORY_FIRST_SEGMENT", "PRESETS", "REG_TYPES",
           "ROUTERS", "SPARSITY_CONTROLS", "ModelSpec", "ReMoEConfig"]


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


class ReMoEConfig(PretrainedConfig):
    """Configuration of :class:`remoe.ReMoEForCausalLM`.

    Takes every field of :class:`~remoe.model.spec.BackboneConfig` (``hidden_size``,
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``ffn_hidden_size`` = 4 x hidden by
    default, ...), :class:`~remoe.model.spec.RoutingConfig` (``router``, ``num_experts`` E,
    ``top_k`` k, ``granularity`` G, each router's options) and
    :class:`~remoe.model.spec.SparsityControlConfig` (``lambda0``, ``alpha``, ...) as keyword
    arguments, plus transformers' own (token ids, ``tie_word_embeddings``, ...).
    """

    model_type = "remoe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache field, < 5.24 / 5.24 on

    def __init__(self, **kwargs: Any) -> None:
        spec = kwargs.pop("_validated_spec", None)  # from_spec: validated by its caller
        if spec is None:  # from the flat fields (a user's keywords, a saved config.json)
            if kwargs.get("expert_backend") == "measured":  # a removed opt-in backend: a saved
                kwargs["expert_backend"] = "auto"  # config.json that names it computes as auto
            names = field_types(kwargs.get("router", RoutingConfig.router),
                                kwargs.get("router_module"))
            fields = {k: kwargs.pop(k) for k in list(kwargs)
                      if k in names and k not in TOKEN_IDS or k in ("moe_top_k", "preset")}
            spec = ModelSpec.from_flat(fields)  # another router's options: checked, left out
            spec = _record_router_module(spec)
            spec.validate()  # this path's one validation (a model build never re-checks it)
        else:
            spec = _record_router_module(spec)
        for name, value in spec.flat().items():
            setattr(self, _attr(name), value)
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

    # transformers' generic code looks for these names
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # the model config, deserialised from the (possibly edited) flat attributes: read it once
    # where it is used many times (a model build reads it once for all its layers)
    @property
    def spec(self) -> ModelSpec:
        opts = user_options_class(self.router, self.router_module)
        names = [f.name for f in dataclasses.fields(opts)] if opts is not None else []
        names += section_fields()
        return ModelSpec.from_flat({k: getattr(self, _attr(k)) for k in names})

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
        return bool(registry.declares(self.router, "is_moe"))

    @property
    def uses_adaptive_reg(self) -> bool:
        """The router's reg_loss is scaled by the adaptive lambda (ReLU)."""
        return bool(registry.declares(self.router, "uses_adaptive_reg"))

    @property
    def target_sparsity(self) -> float:
        """The sparsity ReMoE steers to (:attr:`RoutingConfig.target_sparsity`)."""
        return self.routing.target_sparsity

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "ReMoEConfig":
        """As transformers', with ``top_k=`` overrides mapped onto ``moe_top_k``."""
        if "top_k" in kwargs:
            kwargs["moe_top_k"] = kwargs.pop("top_k")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ReMoEConfig":
        return cls(preset=name, **overrides)  # the spec expands it (ModelSpec.from_flat)

    def moe_config(self, spec: ModelSpec | None = None):
        """The MoE layer's config (:class:`remoe.model.moe.MoEConfig`): the routing section
        itself, plus the widths and init of the backbone (of ``spec``, if given: the one the
        caller already read)."""
        from remoe.model.moe import MoEConfig

        spec = spec or self.spec
        b = spec.backbone
        return MoEConfig(b.hidden_size, b.ffn_hidden_size, spec.routing, b.init_std)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line naming the field) on an impossible config
        (after editing attributes; the constructor has validated what it was given)."""
        self.spec.validate()


if __name__.split(".")[0] == "remoe":  # the package (not a copy bundled by remoe.model.bundle)
    AutoConfig.register("remoe", ReMoEConfig, exist_ok=True)

# the constructor's keywords, for help() and inspect.signature (read by a few tools)
ReMoEConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in defaults().items()]
    + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
