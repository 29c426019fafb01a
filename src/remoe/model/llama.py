"""A LLaMA-style decoder whose FFNs are dense, dense x E, or MoE layers with any router.

Legend: B batch, S new positions, P cached+new positions, D model width, Hq/Hkv query/KV heads,
Dh head width, V vocabulary, L layers, N experts per MoE layer.

Pre-norm RMSNorm blocks, RoPE, grouped-query attention through
``F.scaled_dot_product_attention(..., enable_gqa=True)``, untied embeddings, no biases
(options: q/k/v biases, q/k RMSNorm, a shared expert; see :class:`Attention`).
``ReMoEForCausalLM`` is a transformers ``PreTrainedModel`` + ``GenerationMixin``: it gets
``save_pretrained``/``from_pretrained`` (safetensors) and ``generate`` (KV cache) from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # transformers' per-layer activation checkpointing (gradient_checkpointing_enable)
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers: a plain module, no checkpointing
    GradientCheckpointingLayer = nn.Module

from remoe.model.config import ReMoEConfig
from remoe.model import registry
from remoe.model.losses import (chunked_lm_loss, layer_sparsity_of, lm_loss, next_token_loss,
                                sparsity_of)
from remoe.model.moe import LayerAux, MoEConfig, MoELayer, build_ffn
from remoe.model.routers.base import RouterContext
from remoe.model.spec import BackboneConfig, ModelSpec


@dataclass
class MoEAux:
    """Routing losses and statistics of one forward pass, as tensors (reduce once per step)."""

    reg_loss: Tensor  # L_reg: mean over MoE layers of each layer's term (paper's 1/L)
    aux_loss: Tensor  # sum over layers of fixed-weight auxiliary losses (TopK LB loss)
    active_counts_LN: Tensor  # [L_moe, N] tokens routed to each expert of each MoE layer
    num_tokens: int  # T tokens in this forward
    masks: list[Tensor] | None = None  # per MoE layer bool [T, N] when record_masks=True
    reg_losses_L: Tensor | None = None  # [L_moe]: each MoE layer's L_reg term (per-layer lambda)
    #: MoE layers whose dispatch plan was cut by its capacity (``capacity=``; a 0-d tensor), or
    #: None when no layer had a capacity: the forward is not exact and its step must be redone
    overflow: Tensor | None = None

    @property
    def num_moe_layers(self) -> int:
        return self.active_counts_LN.shape[0]

    @property
    def layer_sparsity(self) -> Tensor:
        """[L_moe]: 1 - active pairs / (T * N) per layer."""
        return layer_sparsity_of(self.active_counts_LN, self.num_tokens)

    @property
    def sparsity(self) -> Tensor:
        """S: 1 - active pairs / (L * T * N) (paper eq. 7); 0 for a model without MoE layers."""
        return sparsity_of(self.active_counts_LN, self.num_tokens)


@dataclass
class ReMoEOutput(CausalLMOutputWithPast):
    """``loss`` is the LM loss alone; routing losses and statistics are in ``aux``."""

    aux: MoEAux | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(pos_BS: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_BS.device,
                                              dtype=torch.float32) / head_dim))
    ang_BSd = pos_BS.float().unsqueeze(-1) * inv_freq
    ang = torch.cat([ang_BSd, ang_BSd], dim=-1)[:, None]  # [B, 1, S, Dh]
    return ang.cos(), ang.sin()


def apply_rope(x_BHSDh: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHSDh.float() * cos + rotated.float() * sin).to(x_BHSDh.dtype)


class Attention(nn.Module):
    """Grouped-query attention with RoPE and an optional transformers KV cache.

    Options (off by default): ``attention_bias`` gives q/k/v biases (Qwen2); ``qk_norm``
    applies an RMSNorm over the whole query and key projections (``Hq*Dh`` and ``Hkv*Dh``
    wide, eps ``rms_norm_eps``) before RoPE (OLMoE)."""

    def __init__(self, cfg: BackboneConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_q, self.n_kv, self.dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        D = cfg.hidden_size
        bias = bool(cfg.attention_bias)
        self.q_proj = nn.Linear(D, self.n_q * self.dh, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv * self.dh, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv * self.dh, bias=bias)
        self.o_proj = nn.Linear(self.n_q * self.dh, D, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.n_q * self.dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.n_kv * self.dh, cfg.rms_norm_eps)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None,
                cache: DynamicCache | None) -> Tensor:
        B, S, _ = x_BSD.shape
        q, k = self.q_proj(x_BSD), self.k_proj(x_BSD)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_q, self.dh).transpose(1, 2)
        k = k.view(B, S, self.n_kv, self.dh).transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, self.n_kv, self.dh).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if attn_mask is None:
            # no padding, no cached prefix (or a single new position): plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1 and k.shape[2] == S,
                                                 enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_q * self.dh))


class DecoderBlock(GradientCheckpointingLayer):
    """Pre-norm block; under ``gradient_checkpointing_enable()`` (non-reentrant) its activations
    are recomputed in backward. The routing statistics of the recomputation are discarded (the
    forward's are the ones returned), so each step counts them once."""

    def __init__(self, cfg: BackboneConfig, layer_idx: int, moe_cfg: MoEConfig,
                 ffn_cls: type | None = None) -> None:
        """``cfg``: the backbone section; ``moe_cfg``/``ffn_cls``: the FFN slot's config and
        class, made once per model build."""
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = build_ffn(moe_cfg, ffn_cls)

    def forward(self, x, cos, sin, attn_mask, cache, ctx: RouterContext) -> tuple[Tensor, LayerAux]:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, cache)
        y, aux = self.ffn(self.ffn_norm(x), ctx)
        return x + y, aux


def _attention_mask(attention_mask_BP: Tensor | None, S: int, P: int, device) -> Tensor | None:
    """Boolean [B, 1, S, P] mask (True = attend) or None when plain causal attention is exact."""
    has_padding = attention_mask_BP is not None and not bool(attention_mask_BP.all())
    if not has_padding and (S == P or S == 1):
        return None
    causal_SP = torch.ones(S, P, dtype=torch.bool, device=device).tril(diagonal=P - S)
    mask = causal_SP[None, None]
    if has_padding:
        mask = mask & attention_mask_BP[:, None, None, -P:].bool()
        # a fully-masked row (left padding queries) would give NaN: let it see itself
        mask = mask | torch.eye(S, P, dtype=torch.bool, device=device).roll(P - S, 1)[None, None]
    return mask


def _left_padding(attention_mask_BP: Tensor | None) -> list[int] | None:
    """Each row's count of masked positions before its first attended one; None when nothing
    is masked (a host sync only for a padded batch)."""
    if attention_mask_BP is None or attention_mask_BP.dim() != 2 or bool(attention_mask_BP.all()):
        return None
    return attention_mask_BP.long().argmax(-1).tolist()


def _block_contexts(ctx: RouterContext, blocks, revive: list | None,
                    capacity: list | None = None) -> list[RouterContext]:
    """Each block's router context: ``ctx``, with ``revive`` and ``capacity`` (one entry per MoE
    layer each, in order) that layer's ``revive_N`` and ``capacity``."""
    if revive is None and capacity is None:
        return [ctx] * len(blocks)
    moe = [isinstance(b.ffn, MoELayer) for b in blocks]
    for name, per_layer in (("revive", revive), ("capacity", capacity)):
        if per_layer is not None and len(per_layer) != sum(moe):
            raise ValueError(f"{name} has {len(per_layer)} entries for {sum(moe)} MoE layers")
    revive_rows = iter(revive) if revive is not None else None
    caps = iter(capacity) if capacity is not None else None
    out = []
    for m in moe:
        if not m:
            out.append(ctx)
            continue
        fields = {}
        if revive_rows is not None:
            fields["revive_N"] = next(revive_rows)
        if caps is not None:
            fields["capacity"] = next(caps)
        out.append(dataclasses.replace(ctx, **fields))
    return out


#: the field of transformers' causal-LM output that holds the KV cache (renamed in 5.24)
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


def _check_cache(past_key_values: Any, cache: Any) -> Any:
    """The KV cache, passed as ``past_key_values=`` (transformers < 5.24) or ``cache=`` (5.24 on;
    both at once only if they are the same object); refuses a static (compileable) cache."""
    if cache is not None:
        if past_key_values is not None and past_key_values is not cache:
            raise ValueError("two KV caches given: pass past_key_values= or cache=, not both")
        past_key_values = cache
    if past_key_values is not None and getattr(past_key_values, "is_compileable", False):
        raise ValueError(f"{type(past_key_values).__name__} is not supported: remoe models "
                         "decode with a dynamic KV cache only (leave cache_implementation unset)")
    return past_key_values


class ReMoEPreTrainedModel(PreTrainedModel):
    config_class = ReMoEConfig
    base_model_prefix = "remoe"
    supports_gradient_checkpointing = True
    # forward(num_items_in_batch=...) normalises the LM loss by the tokens of the whole
    # accumulated batch (transformers' Trainer then does not divide by the accumulation steps)
    accepts_loss_kwargs = True
    _no_split_modules = ["DecoderBlock"]
    _supports_cache_class = True
    _supports_sdpa = True

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    **kwargs: Any) -> None:
        """As transformers', refusing ``use_reentrant=True``: a block returns its routing losses
        beside the hidden states, and the reentrant variant would cut their gradient."""
        if enable and getattr(gradient_checkpointing_func, "keywords", {}).get("use_reentrant"):
            raise ValueError("gradient checkpointing with use_reentrant=True is not supported: the "
                             "routers' L_reg would get no gradient; pass gradient_checkpointing_"
                             "kwargs={'use_reentrant': False} (the default)")
        if gradient_checkpointing_func is None:
            return super()._set_gradient_checkpointing(enable, **kwargs)
        return super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.spec.backbone.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:  # attention_bias: zeros at init
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif hasattr(module, "reset_parameters") and module.__class__.__module__.startswith("remoe"):
            module.reset_parameters()


class ReMoEForCausalLM(ReMoEPreTrainedModel, GenerationMixin):
    """Decoder-only LM. ``forward(input_ids, labels=...)`` returns :class:`ReMoEOutput`."""

    def __init__(self, config: ReMoEConfig) -> None:
        super().__init__(config)
        # the model config read once (validated when it was made): every part of the model
        # reads its section; the FFN slot's config built once and its router (or FFN kind)
        # resolved once, for every layer
        self.spec: ModelSpec = config.spec
        b = self.spec.backbone
        moe_cfg, ffn_cls = MoEConfig.of(self.spec), registry.resolve(self.spec.routing.router)
        self.embed_tokens = nn.Embedding(b.vocab_size, b.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(b, i, moe_cfg, ffn_cls)
                                    for i in range(b.num_layers))
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.lm_head = nn.Linear(b.hidden_size, b.vocab_size, bias=False)
        self.rope = (b.head_dim, b.rope_theta)  # rotary width and base (rope_cos_sin)
        self.compiled_lm_loss = None  # train.compile_loss (compile_lm_loss)
        self.post_init()

    def compile_lm_loss(self, **options) -> None:
        """A forward with ``labels`` now runs the LM head + loss as one compiled function
        (:func:`remoe.model.losses.lm_loss`) and returns no logits; weights and state dict
        unchanged, the loss equal up to the order of the sums."""
        self.compiled_lm_loss = torch.compile(lm_loss, **options)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> Any:
        """transformers' save, then the model's code and ``auto_map`` (loads with
        ``trust_remote_code=True`` without remoe), the tokenizer files and model card of the
        directory it was loaded from (:mod:`remoe.model.bundle`)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            from remoe.model.bundle import finish_save

            finish_save(self, save_directory)
        return out

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool | None = None,
        train_step: int | None = None,
        record_masks: bool = False,
        revive: list[Tensor | None] | None = None,
        capacity: list[int] | None = None,
        loss_chunk_tokens: int = 0,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        cache: DynamicCache | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs: Any,
    ) -> ReMoEOutput | tuple:
        """``labels`` are the inputs (shifted inside, -100 ignored) as in transformers.

        ``train_step``: the optimizer step (schedules such as TopK warm-up); ``None`` means
        inference. ``record_masks``: also return every MoE layer's boolean routing mask.
        ``revive`` (training): per MoE layer, the experts under revival (bool ``[N]`` or None),
        given to its router as ``RouterContext.revive_N`` (remoe.method.sparsity).
        ``capacity`` (training on a GPU): per MoE layer, the pair capacity of its on-device
        dispatch plan (``RouterContext.capacity``; remoe.train.control.CapacityPlan).
        ``loss_chunk_tokens`` (with ``labels``): the LM head and loss over chunks of this many
        tokens (:func:`chunked_lm_loss`; ``logits`` is then None); 0: the whole batch, compiled
        after :meth:`compile_lm_loss` (``logits`` None too).
        The KV cache comes as ``past_key_values=`` (transformers < 5.24) or ``cache=``
        (5.24 on); a dynamic cache only (:func:`_check_cache`).
        ``output_hidden_states``: the embeddings and every block's output, the last one after
        the final norm (L + 1 tensors, transformers' convention); ``output_attentions`` is
        refused (SDPA computes no weights); ``return_dict=False`` returns ``to_tuple()``.
        """
        past_key_values = _check_cache(past_key_values, cache)
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: remoe's attention runs "
                             "F.scaled_dot_product_attention, which returns no attention weights")
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        B, S = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if (use_cache or past_key_values is not None) else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and not bool(attention_mask.all()):
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -S:]
            else:
                position_ids = torch.arange(past, past + S, device=input_ids.device).expand(B, S)
        cos, sin = rope_cos_sin(position_ids, *self.rope)
        attn_mask = _attention_mask(attention_mask, S, past + S, input_ids.device)
        ctx = RouterContext(batch_size=B, seq_len=S, token_ids_T=input_ids.reshape(-1),
                            step=train_step, record_masks=record_masks, past_len=past,
                            pad_left=_left_padding(attention_mask))

        x = self.embed_tokens(input_ids)
        layer_aux: list[LayerAux] = []
        hidden: list[Tensor] = []
        for block, block_ctx in zip(self.layers, _block_contexts(ctx, self.layers, revive,
                                                                      capacity)):
            if output_hidden_states:
                hidden.append(x)
            x, aux = block(x, cos, sin, attn_mask, cache, block_ctx)
            layer_aux.append(aux)
        x = self.norm(x)
        if output_hidden_states:
            hidden.append(x)
        loss = logits = None
        num_items = kwargs.get("num_items_in_batch")
        if labels is not None and loss_chunk_tokens and not logits_to_keep:
            loss = chunked_lm_loss(x, self.lm_head.weight, labels, loss_chunk_tokens, num_items)
        elif labels is not None and self.compiled_lm_loss is not None and not logits_to_keep:
            loss = self.compiled_lm_loss(x, self.lm_head.weight, labels, num_items)
        else:
            if logits_to_keep:
                x = x[:, -logits_to_keep:]
            logits = self.lm_head(x)
        if labels is not None and logits is not None:
            loss = next_token_loss(logits, labels, num_items)
        out = ReMoEOutput(loss=loss, logits=logits, **{_CACHE_FIELD: cache},
                          hidden_states=tuple(hidden) if output_hidden_states else None,
                          aux=self._collect_aux(layer_aux, B * S, input_ids.device))
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True) is not False
        return out if return_dict else out.to_tuple()

    def _collect_aux(self, layer_aux: list[LayerAux], T: int, device) -> MoEAux:
        routed = [a for a in layer_aux if a.active_counts_N.numel() > 0]
        zero = torch.zeros((), device=device)
        if not routed:
            return MoEAux(zero, zero, torch.zeros(0, 0, device=device), T)
        reg_L = torch.stack([a.reg_loss for a in routed])
        reg = reg_L.mean()
        aux = torch.stack([a.aux_loss for a in layer_aux]).sum()
        counts = torch.stack([a.active_counts_N for a in routed])
        masks = [a.mask_TN for a in routed] if routed[0].mask_TN is not None else None
        cut = [a.overflow for a in routed if a.overflow is not None]
        overflow = torch.stack(cut).sum() if cut else None
        return MoEAux(reg, aux, counts, T, masks, reg_L, overflow)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False,
                       active: bool = False) -> int:
        """Parameter count; ``active=True`` counts only the k*G experts a token uses per layer."""
        total = super().num_parameters(only_trainable=only_trainable,
                                       exclude_embeddings=exclude_embeddings)
        if not active:
            return total
        inactive = 0
        for block in self.layers:
            experts = getattr(block.ffn, "experts", None)
            if experts is None or not hasattr(experts, "w_in_ND2H"):
                continue
            cfg = block.ffn.cfg
            per_expert = (experts.w_in_ND2H[0].numel() + experts.w_out_NHD[0].numel())
            # experts a token uses: k*G, unless the FFN or its router says otherwise
            # (Lory merges all E; Expert-Choice averages k*G*capacity_factor)
            used = getattr(block.ffn, "active_experts_per_token", None)
            if used is None:
                used = getattr(getattr(block.ffn, "router", None), "active_experts_per_token",
                               cfg.routing.num_active)
            inactive += (cfg.num_routed - used) * per_expert
        return int(round(total - inactive))


if __name__.split(".")[0] == "remoe":  # the package (not a copy bundled by remoe.model.bundle)
    from transformers import AutoModelForCausalLM

    # model_type "remoe" for transformers' AutoModelForCausalLM (AutoConfig: remoe.model.config)
    AutoModelForCausalLM.register(ReMoEConfig, ReMoEForCausalLM, exist_ok=True)
