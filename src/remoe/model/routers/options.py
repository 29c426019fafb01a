"""The built-in routers' own options: one frozen dataclass per router, declared by its class.

Each router class names its options dataclass in its ``options`` attribute (as a user router
passes ``register_router(name, options=...)``); :data:`remoe.model.registry.BUILTIN_OPTIONS`
maps each built-in name to it by dotted path, so reading or checking a config imports this
module only: no torch. The YAML keys are the field names (``model.lb_coeff``, ...), one
level with the model's other fields; an option lives in ``RoutingConfig.options`` only while
its router is chosen. A field is declared once: options shared by several routers (the TopK
family's ``lb_coeff`` and ``topk_normalize``) sit in a small base class that those routers'
options derive from. The two threshold routers keep theirs in their own files.

Each class's ``validate(prefix)`` raises :class:`remoe.errors.ConfigError` with one line
naming the field; cross-field checks (``warmup_k`` <= E, Lory's k = G = 1) are the router
class's ``validate_config`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from remoe.errors import check
from remoe.model.checks import is_int, is_real, nonnegative_reals, one_of, positive_ints

REG_TYPES = ("lb", "l1")  # ReLU's L_reg: eq. 9 (load-balanced) | eq. 8 (plain L1)
LORY_FIRST_SEGMENT = ("uniform", "self")  # Lory's first segment: 1/E weights | own mean (leaks)


@dataclass(frozen=True)
class _Options:
    """Root of the built-in options (cooperative ``validate``)."""

    def validate(self, p: str = "model.") -> None:
        pass


@dataclass(frozen=True)
class ReLUOptions(_Options):
    """``relu`` (ReMoE). All off by default, which is the paper's router."""

    reg_type: str = "lb"  # "lb" (eq. 9) or "l1" (eq. 8)
    revive_coeff: float = 1e-2  # weight of the dead-expert revival hinge
    max_active: int = 0  # at most this many experts per token (0: no cap, the paper)
    # gates ReLU(x W + b) with a per-expert offset b moved by this much per step toward
    # balanced loads (auxiliary-loss-free balancing; 0: off, the paper)
    balance_bias_rate: float = 0.0
    gate_threshold: float = 0.0  # inference only: gates <= tau count as inactive

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        one_of(self, "reg_type", REG_TYPES, p)
        nonnegative_reals(self, ("revive_coeff", "gate_threshold", "balance_bias_rate"), p)
        check(is_int(self.max_active) and self.max_active >= 0,
              f"{p}max_active={self.max_active!r} must be an integer >= 0 (0: off)")


@dataclass(frozen=True)
class LoadBalancingOption(_Options):
    """The TopK family's Switch load-balancing weight."""

    lb_coeff: float = 0.01

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        check(is_real(self.lb_coeff) and self.lb_coeff >= 0,
              f"{p}lb_coeff={self.lb_coeff!r} must be >= 0")


@dataclass(frozen=True)
class NormalizeOption(_Options):
    """Renormalise the kept probabilities to sum to 1 (Mixtral's TopK)."""

    topk_normalize: bool = False

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        check(isinstance(self.topk_normalize, bool),
              f"{p}topk_normalize={self.topk_normalize!r} must be true or false")


@dataclass(frozen=True)
class TopKOptions(LoadBalancingOption, NormalizeOption):
    """``topk`` (dMoE)."""


@dataclass(frozen=True)
class TopKWarmupOptions(TopKOptions):
    """``topk_warmup`` (Appendix F): ``warmup_k`` experts for ``warmup_steps`` steps, then k."""

    warmup_k: int = 6
    warmup_steps: int = 100

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        positive_ints(self, ("warmup_k",), p)
        check(is_int(self.warmup_steps) and self.warmup_steps >= 0,
              f"{p}warmup_steps={self.warmup_steps!r} must be an integer >= 0")


@dataclass(frozen=True)
class ExpertChoiceOptions(_Options):
    """``expert_choice``: each expert takes ``capacity_factor * k T / E`` tokens."""

    capacity_factor: float = 1.0

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        check(is_real(self.capacity_factor) and self.capacity_factor > 0,
              f"{p}capacity_factor={self.capacity_factor!r} must be > 0")


@dataclass(frozen=True)
class SparseMixerOptions(LoadBalancingOption):
    """``sparsemixer`` (GRIN)."""

    sparsemixer_jitter: float = 0.01  # GRIN / Phi-3.5-MoE router_jitter_noise

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        check(is_real(self.sparsemixer_jitter) and 0 <= self.sparsemixer_jitter < 1,
              f"{p}sparsemixer_jitter={self.sparsemixer_jitter!r} must be in [0, 1)")


@dataclass(frozen=True)
class AuxFreeOptions(NormalizeOption):
    """``topk_auxfree`` (DeepSeek-V3's expert bias)."""

    bias_update_rate: float = 1e-3  # expert-bias step per optimizer step

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        nonnegative_reals(self, ("bias_update_rate",), p)


@dataclass(frozen=True)
class BlockFFNOptions(_Options):
    """``blockffn``: ReLU + RMSNorm, chunk sparsification and activation locality."""

    blockffn_locality_coeff: float = 2e-3  # weight of the activation-locality loss
    blockffn_chunk_len: int = 64  # tokens per chunk of the chunk-sparsification loss

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        nonnegative_reals(self, ("blockffn_locality_coeff",), p)
        positive_ints(self, ("blockffn_chunk_len",), p)


@dataclass(frozen=True)
class LoryOptions(_Options):
    """``lory`` (an FFN kind): segment-level expert merging."""

    lory_segment_len: int = 256
    lory_first_segment: str = "uniform"  # "uniform" (causal) | "self" (Lory's Algorithm 1)

    def validate(self, p: str = "model.") -> None:
        super().validate(p)
        positive_ints(self, ("lory_segment_len",), p)
        one_of(self, "lory_first_segment", LORY_FIRST_SEGMENT, p)


__all__ = ["AuxFreeOptions", "BlockFFNOptions", "ExpertChoiceOptions", "LORY_FIRST_SEGMENT",
           "LoadBalancingOption", "LoryOptions", "NormalizeOption", "REG_TYPES", "ReLUOptions",
           "SparseMixerOptions", "TopKOptions", "TopKWarmupOptions"]
