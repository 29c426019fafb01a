"""Names for ``model.router``: the token routers and FFN kinds, and what each one declares.

A name resolves to a class. Token routers subclass :class:`remoe.model.routers.Router` and sit
inside the MoE layer; FFN kinds (``dense``, ``dense_wide``, ``lory``) replace the whole FFN
slot. Each class declares, as class attributes, what the rest of remoe needs to know, so no
other module spells a router's name:

==================== ====================================================================
``is_moe``            the slot routes tokens to experts (False: a dense FFN)
``adaptive_reg``      its ``reg_loss`` is scaled by the adaptive lambda controller (ReLU)
``has_router_weights`` it has a learned ``[N, D]`` router (FLOPs: ``2 D N`` per token)
``expert_parallel``   ``train.expert_parallel`` can shard its experts
``uses_all_params``   every parameter gets a gradient every step (False: DDP must look for
                      unused ones)
``options``           the dataclass of its own options (:data:`BUILTIN_OPTIONS`, or
                      ``register_router(options=)``), None when it has none
==================== ====================================================================

and a classmethod ``from_config(cfg: MoEConfig)``. A user's router registers itself with
``@register_router("name")`` when its module is imported; ``model.router_module`` names such a
module (imported before validation, and recorded in config.json), so ``remoe train``/``eval``/``analyze``/``bench`` use it with no edit
to remoe (docs/ROUTERS.md). The built-ins are imported lazily, by dotted path, so this module
imports nothing heavy and sits below every package.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from remoe.errors import ConfigError

#: built-in names -> "module:Class" (imported on first use). Order = documentation order.
BUILTINS: dict[str, str] = {
    "relu": "remoe.model.routers.relu:ReLURouter",  # ReMoE (this paper)
    "topk": "remoe.model.routers.topk:TopKRouter",  # dMoE, Switch LB loss
    "topk_warmup": "remoe.model.routers.topk:TopKWarmupRouter",  # Appendix F warm-up
    "hash": "remoe.model.routers.hash:HashRouter",  # token id mod E
    "expert_choice": "remoe.model.routers.expert_choice:ExpertChoiceRouter",
    "sparsemixer": "remoe.model.routers.sparsemixer:SparseMixerRouter",  # GRIN
    "topk_auxfree": "remoe.model.routers.topk_auxfree:AuxFreeTopKRouter",  # DeepSeek-V3 bias
    "blockffn": "remoe.model.routers.blockffn:BlockFFNRouter",  # ReLU + RMSNorm, chunk sparsity
    # ReLU(x W - theta), per-expert thresholds steered to k T/E tokens each (no L1 term)
    "relu_threshold": "remoe.model.routers.relu_threshold:ReLUThresholdRouter",
    "expert_threshold": "remoe.model.routers.expert_threshold:ExpertThresholdRouter",  # ET, EMA
    "lory": "remoe.model.lory:LoryMoE",  # FFN kind: segment-level expert merging
    "dense": "remoe.model.moe:DenseFFN",  # FFN kind: dense, active width
    "dense_wide": "remoe.model.moe:DenseWideFFN",  # FFN kind: dense, E x the width
}

#: the built-ins whose class adds config checks (``validate_config``): only these are imported
#: to validate a config, so validating the others needs no torch (tests/test_config.py keeps
#: this set equal to the classes that override the hook)
BUILTINS_WITH_CHECKS = frozenset({"topk_warmup", "blockffn", "lory"})

#: the options dataclass each built-in declares (its class's ``options``), by dotted path so
#: that reading a config imports no router module: the torch-free ones live in
#: ``remoe.model.routers.options``; the threshold routers' in their own (torch) modules, imported
#: only when one of them is the chosen router. Names absent here declare none.
_OPTIONS_MODULE = "remoe.model.routers.options"
BUILTIN_OPTIONS: dict[str, str] = {
    "relu": "remoe.model.routers.options:ReLUOptions",
    "topk": "remoe.model.routers.options:TopKOptions",
    "topk_warmup": "remoe.model.routers.options:TopKWarmupOptions",
    "expert_choice": "remoe.model.routers.options:ExpertChoiceOptions",
    "sparsemixer": "remoe.model.routers.options:SparseMixerOptions",
    "topk_auxfree": "remoe.model.routers.options:AuxFreeOptions",
    "blockffn": "remoe.model.routers.options:BlockFFNOptions",
    "relu_threshold": "remoe.model.routers.relu_threshold:ReLUThresholdOptions",
    "expert_threshold": "remoe.model.routers.expert_threshold:ExpertThresholdOptions",
    "lory": "remoe.model.routers.options:LoryOptions",
}

_user: dict[str, type] = {}  # registered at import time by user modules (append-only)
_options: dict[str, type] = {}  # a user router's options dataclass (register_router(options=))


def names() -> tuple[str, ...]:
    """Every name ``model.router`` accepts (built-ins first, then registered ones)."""
    return tuple(BUILTINS) + tuple(n for n in _user if n not in BUILTINS)


def _check_new(name: str, cls: type) -> None:
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
        raise ValueError(f"router name {name!r} must be a non-empty identifier")
    old = _user.get(name)
    if name in BUILTINS or (old is not None and old.__qualname__ != cls.__qualname__):
        raise ValueError(f"router name {name!r} is already taken")
    if not callable(getattr(cls, "from_config", None)):
        raise TypeError(f"{cls.__name__} must define a classmethod from_config(cfg)")


def _check_options(name: str, options: type | None) -> None:
    if options is None:
        return
    if not dataclasses.is_dataclass(options) or not isinstance(options, type):
        raise TypeError(f"router {name!r}: options= must be a dataclass class")
    for f in dataclasses.fields(options):  # (remoe.model.spec refuses names of model fields)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"router {name!r}: option {f.name!r} needs a default")


def register_router(name: str, options: type | None = None):
    """Class decorator: make a :class:`~remoe.model.routers.Router` subclass (token router)
    or an FFN-slot module available as ``model.router=name``.

    ``options``: a dataclass of the router's own config fields, each with a default (and, if
    it has one, a ``validate(prefix)`` method raising ConfigError). They become model keys
    while this router is chosen (``--set model.<option>=...``, ``config.json``), are type-
    checked and reach the router as ``cfg.options.<option>`` in ``from_config``."""

    def deco(cls: type) -> type:
        _check_new(name, cls)
        _check_options(name, options)
        cls.registry_name = name
        cls.options = options  # the class's declaration, as the built-ins'
        _user[name] = cls
        if options is not None:
            _options[name] = options
        return cls

    return deco


def _load(target: str) -> Any:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def options_class(name: str) -> type | None:
    """The options dataclass ``name`` declares (None: it declares none, or nobody registered
    ``name``: validation names that one)."""
    if name in _user:
        return _options.get(name)
    target = BUILTIN_OPTIONS.get(name)
    return _load(target) if target is not None else None


def light_options() -> dict[str, type]:
    """The built-ins' options importable without torch (every ``BUILTIN_OPTIONS`` entry in
    ``remoe.model.routers.options``): their keys are model keys whichever router is chosen, so
    every existing config and ``config.json`` (which stored them all) loads."""
    return {n: _load(t) for n, t in BUILTIN_OPTIONS.items()
            if t.split(":")[0] == _OPTIONS_MODULE}


def resolve(name: str) -> type:
    """The class behind ``name`` (ConfigError naming the field when unknown)."""
    if name in _user:
        return _user[name]
    target = BUILTINS.get(name)
    if target is None:
        raise ConfigError(f"model.router={name!r} must be one of {', '.join(names())} "
                          "(or a router registered by the module named in model.router_module)")
    return _load(target)


def declares(name: str, what: str) -> Any:
    """One declaration of ``name``'s class (see the module docstring)."""
    return getattr(resolve(name), what)


def validate_config(name: str, cfg: Any, prefix: str = "model.") -> None:
    """Run ``name``'s own config checks (``cfg``: the flat model fields as attributes)."""
    if name in _user or name in BUILTINS_WITH_CHECKS:
        resolve(name).validate_config(cfg, prefix)


def is_token_router(name: str) -> bool:
    """True for routers that sit inside the MoE layer (False for FFN kinds)."""
    from remoe.model.routers.base import Router

    return issubclass(resolve(name), Router)


def import_modules(modules: list[str], field: str = "model.router_module") -> None:
    """Import user modules so their ``@register_router`` decorators run."""
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ConfigError(f"{field}: cannot import {m!r}: {e}") from e
