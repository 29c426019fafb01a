"""Model configuration: ``ReMoEConfig``, the transformers config built from a composed spec.

The fields, their defaults and their checks live in :mod:`remoe.model.spec`, in three sections
(backbone, routing, sparsity control), each a dataclass validated once. ``ReMoEConfig`` stores
them flat, one attribute per field, so that it serialises as a Hugging Face ``config.json``
with the same keys as always (old ``config.json`` files load unchanged); ``cfg.backbone``,
``cfg.routing`` and ``cfg.control`` give the sections back. The MoE layer's config
(:class:`remoe.model.moe.MoEConfig`, :meth:`ReMoEConfig.moe_config`) holds the routing section
itself plus the widths it needs, so the layer can be used without the rest of the model.
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
                              field_types)

__all__ = ["EXPERT_BACKENDS", "LAMBDA_UPDATES", "LORY_FIRST_SEGMENT", "PRESETS", "REG_TYPES",
           "ROUTERS", "SPARSITY_CONTROLS", "ModelSpec", "ReMoEConfig"]


def _attr(field: str) -> str:
    # k is stored as `moe_top_k`: transformers treats any config attribute named `top_k` as a
    # sampling setting. `top_k=` is accepted as the constructor's name for it.
    return "moe_top_k" if field == "top_k" else field


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
        if kwargs.get("expert_backend") == "measured":  # a removed opt-in backend: a saved
            kwargs["expert_backend"] = "auto"  # config.json that names it computes as auto
        names = field_types(kwargs.get("router", RoutingConfig.router),
                            kwargs.get("router_module"))
        fields = {k: kwargs.pop(k) for k in list(kwargs)
                  if k in names and k not in TOKEN_IDS or k in ("moe_top_k", "preset")}
        spec = ModelSpec.from_flat(fields)
        r = spec.routing
        # a router registered by a user module: recorded in config.json, so the saved model
        # loads wherever that module is importable (it is imported by validation)
        if not r.router_module and isinstance(r.router, str) and r.router not in registry.BUILTINS \
                and r.router in registry.names():
            spec = dataclasses.replace(spec, routing=dataclasses.replace(
                r, router_module=registry.resolve(r.router).__module__))
        for name, value in spec.flat().items():
            setattr(self, _attr(name), value)
        for name, default in TOKEN_IDS.items():
            kwargs.setdefault(name, default)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate()

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

    # the composition, read from the (possibly edited) flat attributes
    @property
    def spec(self) -> ModelSpec:
        names = [k for k in field_types(self.router, self.router_module) if k not in TOKEN_IDS]
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

    def moe_config(self):
        """The MoE layer's config (:class:`remoe.model.moe.MoEConfig`): the routing section
        itself, plus the widths and init of the backbone."""
        from remoe.model.moe import MoEConfig

        return MoEConfig(d_model=self.hidden_size, d_ffn=self.ffn_hidden_size,
                         init_std=self.init_std, routing=self.routing)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line naming the field) on an impossible config."""
        self.spec.validate()


if __name__.split(".")[0] == "remoe":  # the package (not a copy bundled by remoe.model.bundle)
    AutoConfig.register("remoe", ReMoEConfig, exist_ok=True)

# the constructor's keywords, for help() and inspect.signature (read by a few tools)
ReMoEConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in defaults().items()]
    + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
