"""Model configuration: ``ReMoEConfig`` (a transformers config), presets and validation.

The model config is flat so that it serialises as a Hugging Face ``config.json``; the MoE
layer gets its own small dataclass (:class:`remoe.model.moe.MoEConfig`) built from it by
:meth:`ReMoEConfig.moe_config`, so the layer can be used without the rest of the model.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

from remoe import registry
from remoe.errors import ConfigError

#: The built-in values of ``model.router`` (remoe.registry; user modules may register more).
#: ``dense`` and ``dense_wide`` replace the MoE layer by a dense SwiGLU FFN of width ``d_ffn``
#: and ``num_experts * d_ffn`` ("Dense x E"); ``lory`` is Lory's segment-merging FFN.
ROUTERS = tuple(registry.BUILTINS)
REG_TYPES = ("lb", "l1")
SPARSITY_CONTROLS = ("global", "per_layer")  # one lambda for the model (paper) | one per layer
LAMBDA_UPDATES = ("sign", "pi")  # eq. 6's sign rule (paper) | proportional-integral in log space
EXPERT_BACKENDS = ("auto", "fused", "grouped_mm", "reference")
LORY_FIRST_SEGMENT = ("uniform", "self")  # Lory's first segment: 1/E weights | own mean (leaks)

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


class ReMoEConfig(PretrainedConfig):
    """Configuration of :class:`remoe.ReMoEForCausalLM`.

    Backbone (LLaMA): ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads`` (GQA
    groups), ``ffn_hidden_size`` (default 4 x hidden), ``rope_theta``, ``rms_norm_eps``.
    FFN / routing: ``router`` (one of :data:`ROUTERS`), ``num_experts`` E, ``top_k`` k,
    ``granularity`` G (E*G experts of width d_ffn/G, k*G active), and each router's options.
    Sparsity control (ReLU only): ``reg_type`` ("lb" = eq. 9, "l1" = eq. 8), ``lambda0``,
    ``alpha``. TopK family: ``lb_coeff`` (0.01, the Switch load-balancing weight).
    """

    model_type = "remoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 8192,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        ffn_hidden_size: int | None = None,
        max_position_embeddings: int = 1024,
        rope_theta: float = 1e6,
        rms_norm_eps: float = 1e-5,
        init_std: float = 0.02,
        router: str = "relu",
        router_module: str | None = None,
        num_experts: int = 8,
        top_k: int | None = None,
        granularity: int = 1,
        reg_type: str = "lb",
        lambda0: float = 1e-8,
        alpha: float = 1.2,
        sparsity_control: str = "global",
        lambda_update: str = "sign",
        lambda_pi_kp: float = 1.0,
        lambda_pi_ki: float = 0.25,
        revive_after: int = 0,
        revive_coeff: float = 1e-2,
        max_active: int = 0,
        gate_threshold: float = 0.0,
        topk_normalize: bool = False,
        lb_coeff: float = 0.01,
        capacity_factor: float = 1.0,
        lory_segment_len: int = 256,
        lory_first_segment: str = "uniform",
        warmup_k: int = 6,
        warmup_steps: int = 100,
        sparsemixer_jitter: float = 0.01,
        bias_update_rate: float = 1e-3,
        blockffn_locality_coeff: float = 2e-3,
        blockffn_chunk_len: int = 64,
        expert_backend: str = "auto",
        recompute_experts: bool = False,
        eos_token_id: int | None = 0,
        bos_token_id: int | None = 0,
        pad_token_id: int | None = 0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.ffn_hidden_size = ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.init_std = init_std
        self.router = router
        # a router registered by a user module: the module is imported here (before validation)
        # and recorded in config.json, so the saved model loads wherever it is importable
        if router_module:
            registry.import_modules([router_module], "model.router_module")
        elif isinstance(router, str) and router not in registry.BUILTINS and router in registry.names():
            router_module = registry.resolve(router).__module__
        self.router_module = router_module
        self.num_experts = num_experts
        # k is stored as `moe_top_k`: transformers treats any config attribute named `top_k` as a
        # sampling setting. `top_k=` is accepted as the constructor's name for it.
        self.moe_top_k = top_k if top_k is not None else kwargs.pop("moe_top_k", 1)
        kwargs.pop("moe_top_k", None)
        self.granularity = granularity
        self.reg_type = reg_type
        self.lambda0 = lambda0
        self.alpha = alpha
        self.sparsity_control = sparsity_control
        self.lambda_update = lambda_update
        self.lambda_pi_kp = lambda_pi_kp
        self.lambda_pi_ki = lambda_pi_ki
        self.revive_after = revive_after
        self.revive_coeff = revive_coeff
        self.max_active = max_active
        self.gate_threshold = gate_threshold
        self.topk_normalize = topk_normalize
        self.lb_coeff = lb_coeff
        self.capacity_factor = capacity_factor
        self.lory_segment_len = lory_segment_len
        self.lory_first_segment = lory_first_segment
        self.warmup_k = warmup_k
        self.warmup_steps = warmup_steps
        self.sparsemixer_jitter = sparsemixer_jitter
        self.bias_update_rate = bias_update_rate
        self.blockffn_locality_coeff = blockffn_locality_coeff
        self.blockffn_chunk_len = blockffn_chunk_len
        self.expert_backend = expert_backend
        self.recompute_experts = recompute_experts
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                         pad_token_id=pad_token_id, **kwargs)
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

    @property
    def is_moe(self) -> bool:
        return bool(registry.declares(self.router, "is_moe"))

    @property
    def uses_adaptive_reg(self) -> bool:
        """The router's reg_loss is scaled by the adaptive lambda (ReLU)."""
        return bool(registry.declares(self.router, "uses_adaptive_reg"))

    @property
    def target_sparsity(self) -> float:
        """The sparsity ReMoE steers to: 1 - k/E (G does not change it)."""
        return 1.0 - self.moe_top_k / self.num_experts

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "ReMoEConfig":
        """As transformers', with ``top_k=`` overrides mapped onto ``moe_top_k``."""
        if "top_k" in kwargs:
            kwargs["moe_top_k"] = kwargs.pop("top_k")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ReMoEConfig":
        if name not in PRESETS:
            raise ConfigError(f"model.preset={name!r} must be one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def moe_config(self):
        """The MoE layer's own config (see :class:`remoe.model.moe.MoEConfig`)."""
        from remoe.model.moe import MoEConfig

        return MoEConfig(
            d_model=self.hidden_size, d_ffn=self.ffn_hidden_size, num_experts=self.num_experts,
            top_k=self.moe_top_k, granularity=self.granularity, router=self.router,
            reg_type=self.reg_type, lb_coeff=self.lb_coeff, revive_coeff=self.revive_coeff,
            max_active=self.max_active, gate_threshold=self.gate_threshold,
            topk_normalize=self.topk_normalize, capacity_factor=self.capacity_factor,
            lory_segment_len=self.lory_segment_len, lory_first_segment=self.lory_first_segment,
            warmup_k=self.warmup_k,
            warmup_steps=self.warmup_steps, sparsemixer_jitter=self.sparsemixer_jitter,
            bias_update_rate=self.bias_update_rate,
            blockffn_locality_coeff=self.blockffn_locality_coeff,
            blockffn_chunk_len=self.blockffn_chunk_len,
            expert_backend=self.expert_backend, recompute_experts=self.recompute_experts,
            init_std=self.init_std,
        )

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one line naming the field) on an impossible config."""
        validate_model_fields(self)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _real(v: Any) -> bool:
    """A finite int/float that is not a bool (YAML `true` must not pass as 1)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _k(c: Any) -> int:
    return c.moe_top_k if hasattr(c, "moe_top_k") else c.top_k


def validate_model_fields(c: Any, prefix: str = "model.") -> None:
    """Checks shared by :class:`ReMoEConfig` and the YAML loader (``c`` has the same fields)."""
    p = prefix
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "ffn_hidden_size", "max_position_embeddings", "num_experts", "top_k",
                 "granularity", "lory_segment_len", "warmup_k", "blockffn_chunk_len"):
        v = _k(c) if name == "top_k" else getattr(c, name)
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
              f"{p}{name}={v!r} must be a positive integer")
    _need(isinstance(c.router, str) and c.router in registry.names(),
          f"{p}router={c.router!r} must be one of {', '.join(registry.names())} (or a router "
          "registered by the module named in model.router_module)")
    _need(c.reg_type in REG_TYPES, f"{p}reg_type={c.reg_type!r} must be one of {', '.join(REG_TYPES)}")
    _need(c.expert_backend in EXPERT_BACKENDS,
          f"{p}expert_backend={c.expert_backend!r} must be one of {', '.join(EXPERT_BACKENDS)}")
    _need(c.hidden_size % c.num_heads == 0,
          f"{p}num_heads={c.num_heads} must divide {p}hidden_size={c.hidden_size}")
    _need(c.num_heads % c.num_kv_heads == 0,
          f"{p}num_kv_heads={c.num_kv_heads} must divide {p}num_heads={c.num_heads}")
    _need((c.hidden_size // c.num_heads) % 2 == 0,
          f"{p}hidden_size/num_heads={c.hidden_size // c.num_heads} must be even (RoPE)")
    _need(_k(c) <= c.num_experts, f"{p}top_k={_k(c)} must be <= {p}num_experts={c.num_experts}")
    _need(c.ffn_hidden_size % c.granularity == 0,
          f"{p}granularity={c.granularity} must divide {p}ffn_hidden_size={c.ffn_hidden_size}")
    registry.resolve(c.router).validate_config(c, p)  # the router's own checks
    _need(_real(c.alpha) and c.alpha > 1.0, f"{p}alpha={c.alpha!r} must be a finite number > 1")
    _need(_real(c.lambda0) and c.lambda0 > 0,
          f"{p}lambda0={c.lambda0!r} must be a positive finite number")
    _need(getattr(c, "sparsity_control", "global") in SPARSITY_CONTROLS,
          f"{p}sparsity_control={getattr(c, 'sparsity_control', None)!r} must be one of "
          f"{', '.join(SPARSITY_CONTROLS)}")
    _need(getattr(c, "lambda_update", "sign") in LAMBDA_UPDATES,
          f"{p}lambda_update={getattr(c, 'lambda_update', None)!r} must be one of "
          f"{', '.join(LAMBDA_UPDATES)}")
    for name in ("lambda_pi_kp", "lambda_pi_ki", "revive_coeff", "gate_threshold",
                 "bias_update_rate", "blockffn_locality_coeff"):
        v = getattr(c, name, 0.0)
        _need(_real(v) and v >= 0, f"{p}{name}={v!r} must be a finite number >= 0")
    for name in ("revive_after", "max_active"):
        v = getattr(c, name, 0)
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              f"{p}{name}={v!r} must be an integer >= 0 (0: off)")
    _need(isinstance(getattr(c, "topk_normalize", False), bool),
          f"{p}topk_normalize={getattr(c, 'topk_normalize', None)!r} must be true or false")
    _need(_real(c.lb_coeff) and c.lb_coeff >= 0, f"{p}lb_coeff={c.lb_coeff!r} must be >= 0")
    _need(_real(c.capacity_factor) and c.capacity_factor > 0,
          f"{p}capacity_factor={c.capacity_factor!r} must be > 0")
    _need(isinstance(c.warmup_steps, int) and not isinstance(c.warmup_steps, bool)
          and c.warmup_steps >= 0, f"{p}warmup_steps={c.warmup_steps!r} must be an integer >= 0")
    _need(_real(c.sparsemixer_jitter) and 0 <= c.sparsemixer_jitter < 1,
          f"{p}sparsemixer_jitter={c.sparsemixer_jitter!r} must be in [0, 1)")
    lfs = getattr(c, "lory_first_segment", "uniform")
    _need(lfs in LORY_FIRST_SEGMENT, f"{p}lory_first_segment={lfs!r} must be one of "
          f"{', '.join(LORY_FIRST_SEGMENT)}")
    _need(_real(c.rope_theta) and c.rope_theta > 0, f"{p}rope_theta={c.rope_theta!r} must be > 0")
    _need(_real(c.rms_norm_eps) and c.rms_norm_eps > 0,
          f"{p}rms_norm_eps={c.rms_norm_eps!r} must be > 0")
    _need(_real(c.init_std) and c.init_std > 0, f"{p}init_std={c.init_std!r} must be > 0")
