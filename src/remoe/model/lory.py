"""Lory (Zhong et al., 2024): fully differentiable MoE by segment-level expert *merging*.

Legend: B batch, S positions in this call, D model width, H expert width (d_ffn), E experts,
L segment length (``lory_segment_len``), M segments.

Each sequence is cut into consecutive segments of L positions (the last one may be shorter).
Segment m is processed by ONE SwiGLU FFN whose weights are the routing-weighted sum of the E
experts' weights (SMEAR-style merging, so the whole layer is differentiable; no discrete choice):

    r_m   = softmax(W_r  mean_{t in segment m-1} x_t)           (E routing weights, fp32)
    W*_m  = sum_e r_m,e W_e   (gate/up [D, 2H] and down [H, D])
    y_t   = SwiGLU(x_t; W*_m)  for t in segment m

The routing of segment m uses the *previous* segment's mean representation (Lory's causal
segment routing), so no information flows from a later position to an earlier output.
The first segment has no previous segment; ``first_segment`` chooses its routing weights:

* ``"uniform"`` (default): ``r_0 = 1/E`` (the average expert). Strictly causal. The router gets
  no gradient from segment 0, as in Lory, where segment 0's weights are stop-gradient.
* ``"self"``: Lory's Algorithm 1, ``r_0 = stopgrad(softmax(W_r mean(segment 0)))``. This leaks
  information from later tokens of segment 0 into its earlier outputs during training.
  At inference it is Lory's prompt-only routing for as long as generation stays in segment 0:
  a KV-cache continuation of segment 0 reuses the weights computed from the prompt.

No load-balancing loss (Lory trains the router only through the LM loss; all experts receive
gradient from every segment), so ``aux_loss = reg_loss = 0``. Lory's similarity-based data
batching (grouping related documents into one training sequence) is a data-pipeline technique
and is NOT implemented here. ``top_k`` and ``granularity`` must be 1: one merged expert of the
full width is applied per segment.

Statistics: every expert contributes to every token, so ``active_counts_N = T`` for each expert
(the layer's sparsity is 0) and ``num_parameters(active=True)`` counts all experts (they are all
merged into what a token uses). Compute per token is one dense FFN plus the per-segment merge.

Generation with a KV cache (``ctx.past_len > 0``): the layer keeps, per sequence, the running sum
of the current segment's inputs and the routing weights in force. New positions extend the
current segment; when a segment completes, its mean routes the next one -- exactly what a full
forward over the whole sequence computes, so cached decoding matches it (``"uniform"`` mode).
This stream state lives on the module (not in the cache object): it is reset by every forward
with ``past_len == 0`` and checked against ``past_len``; beam search (which reorders caches) is
not supported by Lory. A left-padded batch (batched generation; ``ctx.pad_left``, the padding
count of each sequence) is routed sequence by sequence with the segments starting at each
sequence's first real token, so it generates what each prompt generates alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remoe.errors import ConfigError
from remoe.model.experts import SwiGLUExperts
from remoe.model.moe import LayerAux, MoEConfig
from remoe.model.routers.base import RouterContext
from remoe.model.routers.options import LORY_FIRST_SEGMENT, LoryOptions

FIRST_SEGMENT_MODES = LORY_FIRST_SEGMENT


@dataclass
class _Stream:
    """Where a KV-cache continuation resumes (all tensors detached)."""

    pos: int  # positions processed so far
    seg_sum_BD: Tensor  # fp32 sum of the current (incomplete) segment's inputs
    weights_BE: Tensor | None  # routing weights of the current segment (None: not yet fixed)


class LoryMoE(nn.Module):
    """Lory's FFN slot: causal segment routing + expert merging; returns ``(y, LayerAux)``."""

    options = LoryOptions

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        r, o = cfg.routing, cfg.options
        if r.top_k != 1:
            raise ConfigError(f"model.top_k={r.top_k} must be 1 for model.router=lory "
                              "(one merged expert per segment)")
        if r.granularity != 1:
            raise ConfigError(f"model.granularity={r.granularity} must be 1 for model.router=lory")
        mode = o.lory_first_segment
        if mode not in FIRST_SEGMENT_MODES:
            raise ConfigError(f"model.lory_first_segment={mode!r} must be one of "
                              f"{', '.join(FIRST_SEGMENT_MODES)}")
        if o.lory_segment_len < 1:
            raise ConfigError(f"model.lory_segment_len={o.lory_segment_len} must be >= 1")
        self.cfg = cfg
        self.segment_len = o.lory_segment_len
        self.first_segment = mode
        self.num_experts = r.num_experts
        self.router = nn.Linear(cfg.d_model, r.num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=cfg.init_std)
        # parameter storage only (same stacked layout and count as the token-routed experts)
        self.experts = SwiGLUExperts(r.num_experts, cfg.d_model, cfg.d_ffn, cfg.init_std)
        self._stream: _Stream | list[_Stream] | None = None  # a list: one per padded sequence

    # declarations read through remoe.model.registry (see remoe.model.routers.base.Router)
    is_moe = True
    uses_adaptive_reg = False
    has_router_weights = True
    expert_parallel = False  # merged experts: no token dispatch to shard
    uses_all_params = False  # DDP: the first segment's router may get no gradient

    @classmethod
    def from_config(cls, cfg: MoEConfig) -> "LoryMoE":
        return cls(cfg)

    @classmethod
    def validate_config(cls, cfg, prefix: str = "model.") -> None:
        k, G = cfg.routing.top_k, cfg.routing.granularity
        if k != 1 or G != 1:  # one merged expert of the full width per segment
            raise ConfigError(f"{prefix}router=lory needs {prefix}top_k=1 and "
                              f"{prefix}granularity=1 (got {k} and {G})")

    @classmethod
    def effective_pairs(cls, cfg, counted_pairs: float, tokens: int) -> float:
        """Lory reports every expert as used by every token but computes one merged expert per
        token (plus merging E experts once per segment). ``cfg``: the ModelSpec."""
        r = cfg.routing
        return tokens * cfg.backbone.num_layers * (1.0 + r.num_experts / r.options.lory_segment_len)

    @property
    def active_experts_per_token(self) -> int:
        """All E experts are merged into the FFN every token uses."""
        return self.num_experts

    # ------------------------------------------------------------------ pieces

    def routing_weights(self, mean_BD: Tensor) -> Tensor:
        """``softmax(W_r h)`` over experts, in fp32."""
        with torch.autocast(device_type=mean_BD.device.type, enabled=False):
            return torch.softmax(mean_BD.float() @ self.router.weight.float().t(), dim=-1)

    def merged_ffn(self, x_BsD: Tensor, r_BE: Tensor) -> Tensor:
        """SwiGLU of each sequence's positions with the experts merged by its weights ``r_BE``."""
        w_in, w_out = self.experts.w_in_ND2H, self.experts.w_out_NHD
        w_in_BD2H = torch.einsum("be,edh->bdh", r_BE.to(w_in.dtype), w_in)
        w_out_BHD = torch.einsum("be,ehd->bhd", r_BE.to(w_out.dtype), w_out)
        dt = x_BsD.dtype
        gate, up = torch.bmm(x_BsD, w_in_BD2H.to(dt)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, w_out_BHD.to(dt))

    def _first_weights(self, x_BsD: Tensor, seg_sum_BD: Tensor, count: int) -> Tensor:
        B = x_BsD.shape[0]
        if self.first_segment == "uniform":
            return x_BsD.new_full((B, self.num_experts), 1.0 / self.num_experts, dtype=torch.float32)
        # "self": Lory's stop-gradient routing of segment 0 on its own (so far seen) mean
        mean_BD = (seg_sum_BD + x_BsD.float().sum(1)) / (count + x_BsD.shape[1])
        return self.routing_weights(mean_BD).detach()

    def _segments(self, x_BSD: Tensor, pos: int, seg_sum: Tensor, weights: Tensor | None
                  ) -> tuple[Tensor, _Stream]:
        """The outputs of positions ``pos..pos+S-1`` of every sequence (segment state
        ``seg_sum``/``weights`` at ``pos``), and the state after them."""
        B, S, D = x_BSD.shape
        L = self.segment_len
        outs = []
        start = 0
        while start < S:
            if pos > 0 and pos % L == 0:  # a segment just completed: it routes the next one
                weights = self.routing_weights(seg_sum / L)
                seg_sum = torch.zeros_like(seg_sum)
            stop = min(S, start + (L - pos % L))
            piece = x_BSD[:, start:stop]
            if pos < L and weights is None:  # segment 0
                weights = self._first_weights(piece, seg_sum, pos)
            outs.append(self.merged_ffn(piece, weights))
            seg_sum = seg_sum + piece.float().sum(1)
            pos += stop - start
            start = stop
        y_BSD = torch.cat(outs, dim=1) if outs else x_BSD.new_zeros(B, 0, D)
        return y_BSD, _Stream(pos, seg_sum.detach(),
                              weights.detach() if weights is not None else None)

    @staticmethod
    def _resume(st: _Stream | None, past: int, B: int, device) -> tuple[int, Tensor, Tensor | None]:
        if not isinstance(st, _Stream) or st.pos != past or st.seg_sum_BD.shape[0] != B:
            raise RuntimeError(
                f"Lory layer: a KV-cache continuation at position {past} (batch {B}) does not "
                "follow this layer's previous forward; run the prefix through the model first "
                "(beam search / cache reordering is not supported by Lory)")
        return st.pos, st.seg_sum_BD.to(device), st.weights_BE

    def _forward_left_padded(self, x_BSD: Tensor, past: int, pads: list[int]) -> Tensor:
        """A left-padded batch (batched generation): each sequence's segments start at its
        first real position, as if it were alone; padding positions get zeros. One sequence at a
        time (generation batches are small); the stream state is kept per sequence."""
        B, S, D = x_BSD.shape
        if len(pads) != B:
            raise RuntimeError(f"Lory layer: {len(pads)} padding counts for a batch of {B}")
        if past == 0:
            streams = [None] * B
        else:
            streams = self._stream if isinstance(self._stream, list) else None
            if streams is None or len(streams) != B:
                raise RuntimeError(f"Lory layer: a KV-cache continuation at position {past} "
                                   f"(batch {B}) does not follow a left-padded forward")
        ys, new = [], []
        for b, pad in enumerate(pads):
            x_1SD = x_BSD[b:b + 1]
            if past == 0:  # the prompt: drop the padding, segments start after it
                skip = min(pad, S)
                y, st = self._segments(x_1SD[:, skip:], 0,
                                       x_BSD.new_zeros(1, D, dtype=torch.float32), None)
                y = torch.cat([x_1SD.new_zeros(1, skip, D), y], dim=1)
            else:  # new positions after the cached ones (never padding in left-padded decoding)
                pos, seg_sum, weights = self._resume(streams[b], past - pad, 1, x_BSD.device)
                y, st = self._segments(x_1SD, pos, seg_sum, weights)
            ys.append(y)
            new.append(st)
        self._stream = new
        return torch.cat(ys, dim=0)

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor, ctx: RouterContext | None = None) -> tuple[Tensor, LayerAux]:
        D = x.shape[-1]
        if ctx is None:
            B = x.shape[0] if x.dim() > 2 else 1
            past = 0
        else:
            B, past = ctx.batch_size, getattr(ctx, "past_len", 0)
        x_BSD = x.reshape(B, -1, D)
        S = x_BSD.shape[1]
        T = B * S

        pads = getattr(ctx, "pad_left", None) if ctx is not None else None
        if pads is not None and any(pads):
            y_BSD = self._forward_left_padded(x_BSD, past, pads)
        else:
            if past == 0:
                pos, seg_sum, weights = 0, x_BSD.new_zeros(B, D, dtype=torch.float32), None
            else:
                pos, seg_sum, weights = self._resume(self._stream, past, B, x.device)
            y_BSD, st = self._segments(x_BSD, pos, seg_sum, weights)
            self._stream = st
        z = x.new_zeros((), dtype=torch.float32)
        counts_N = x.new_full((self.num_experts,), float(T), dtype=torch.float32)
        mask = None
        if ctx is not None and ctx.record_masks:
            mask = torch.ones(T, self.num_experts, dtype=torch.bool, device=x.device)
        return y_BSD.reshape(x.shape), LayerAux(z, z, counts_N, T, mask)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, segment_len={self.segment_len}, "
                f"first_segment={self.first_segment!r}")
