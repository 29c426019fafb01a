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
from remoe.model.config import ReMoEConfig


@dataclass
class FlopCounter:
    cfg: ReMoEConfig
    seq_len: int

    def _per_token_fixed(self) -> float:
        c = self.cfg
        D, L, dh = c.hidden_size, c.num_layers, c.head_dim
        attn_proj = D * (c.num_heads * dh) * 2 + D * (c.num_kv_heads * dh) * 2
        attn_scores = 2 * self.seq_len * c.num_heads * dh  # QK^T and AV
        kind = registry.resolve(c.router)
        router = D * c.num_experts * c.granularity if c.is_moe and kind.has_router_weights else 0
        per_layer = 2 * (attn_proj + router) + 2 * attn_scores
        shared = getattr(c, "shared_expert_size", 0)
        if c.is_moe and shared:
            per_layer += 2 * (3 * D * shared + (D if c.shared_expert_gate else 0))
        if not c.is_moe:
            per_layer += 2 * 3 * D * kind.width(c.spec)
        return L * per_layer + 2 * D * c.vocab_size

    def expert_pair_flops(self) -> float:
        """Forward FLOPs of one active (token, expert) pair."""
        c = self.cfg
        return 2 * 3 * c.hidden_size * (c.ffn_hidden_size // c.granularity)

    def forward_flops(self, tokens: int, active_pairs: float) -> float:
        """Forward FLOPs of ``tokens`` tokens whose MoE layers used ``active_pairs`` pairs in all."""
        return tokens * self._per_token_fixed() + active_pairs * self.expert_pair_flops()

    def effective_pairs(self, counted_pairs: float, tokens: int) -> float:
        """Pairs that cost an expert computation. Lory reports every expert as used by every
        token but computes one merged expert per token (plus merging E experts per segment)."""
        return registry.resolve(self.cfg.router).effective_pairs(self.cfg.spec, counted_pairs,
                                                                 tokens)

    def train_flops(self, tokens: int, active_pairs: float) -> float:
        return 3.0 * self.forward_flops(tokens, active_pairs)

    def sparse_train_flops_per_token(self) -> float:
        """Training FLOPs per token at exactly k*G active experts in every MoE layer."""
        c = self.cfg
        pairs = c.num_layers * c.moe_top_k * c.granularity if c.is_moe else 0
        return self.train_flops(1, pairs)
