"""Training FLOPs counted from the experts that were actually active.

Matmul FLOPs only (2 per multiply-add), after Narayanan et al. (2021): per token and layer the
attention projections, the attention scores and values (``2 * 2 * S * D``), the router, and
``2 * 3 * D * H`` per active (token, expert) pair (SwiGLU has three projections); plus the LM
head. A shared expert (``shared_expert_size`` S > 0) costs every token ``2 * 3 * D * S`` in
each MoE layer, plus ``2 * D`` for its gate; attention biases and q/k norms are not matmuls.
Training = 3x forward (backward costs two forwards). ReMoE is denser in stages I-II, so
its FLOPs per step are higher there: this is what makes matched-compute comparisons possible
(paper §4.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from remoe.model import registry
from remoe.model.spec import ModelSpec


@dataclass
class FlopCounter:
    """``spec``: the model config (``ReMoEConfig.spec``, or a model's ``model.spec``)."""

    spec: ModelSpec
    seq_len: int

    @property
    def _is_moe(self) -> bool:
        return bool(registry.declares(self.spec.routing.router, "is_moe"))

    def _per_token_fixed(self) -> float:
        b, r = self.spec.backbone, self.spec.routing
        D, L, dh = b.hidden_size, b.num_layers, b.head_dim
        attn_proj = D * (b.num_heads * dh) * 2 + D * (b.num_kv_heads * dh) * 2
        attn_scores = 2 * self.seq_len * b.num_heads * dh  # QK^T and AV
        kind = registry.resolve(r.router)
        moe = self._is_moe
        router = D * r.num_routed if moe and kind.has_router_weights else 0
        per_layer = 2 * (attn_proj + router) + 2 * attn_scores
        if moe and r.shared_expert_size:
            per_layer += 2 * (3 * D * r.shared_expert_size + (D if r.shared_expert_gate else 0))
        if not moe:
            per_layer += 2 * 3 * D * kind.width(self.spec)
        return L * per_layer + 2 * D * b.vocab_size

    def expert_pair_flops(self) -> float:
        """Forward FLOPs of one active (token, expert) pair."""
        b = self.spec.backbone
        return 2 * 3 * b.hidden_size * (b.ffn_hidden_size // self.spec.routing.granularity)

    def forward_flops(self, tokens: int, active_pairs: float) -> float:
        """Forward FLOPs of ``tokens`` tokens whose MoE layers used ``active_pairs`` pairs in all."""
        return tokens * self._per_token_fixed() + active_pairs * self.expert_pair_flops()

    def effective_pairs(self, counted_pairs: float, tokens: int) -> float:
        """Pairs that cost an expert computation. Lory reports every expert as used by every
        token but computes one merged expert per token (plus merging E experts per segment)."""
        return registry.resolve(self.spec.routing.router).effective_pairs(self.spec,
                                                                          counted_pairs, tokens)

    def train_flops(self, tokens: int, active_pairs: float) -> float:
        return 3.0 * self.forward_flops(tokens, active_pairs)

    def sparse_train_flops_per_token(self) -> float:
        """Training FLOPs per token at exactly k*G experts in every MoE layer."""
        r = self.spec.routing
        pairs = self.spec.backbone.num_layers * r.top_k * r.granularity if self._is_moe else 0
        return self.train_flops(1, pairs)
