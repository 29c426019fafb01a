"""Hash routing (Roller et al., 2021, "Hash Layers For Large Sparse Models").

Legend: T tokens, N experts (E*G), K active experts per token (k*G).

Each token goes to experts fixed by its *token id* alone: no learned routing, no auxiliary loss.
The ReMoE paper's baseline uses ``token_id mod E`` (k=1, G=1), which is what this router does
for K=1. For K>1 (k>1 or fine-grained G>1) the deterministic extension is

    expert_j(id) = (id + j * stride) mod N,   j = 0..K-1,   stride = N // K

``stride >= 1`` and ``(K-1) * stride < N``, so the K experts are always distinct. With K | N
(e.g. k=1, any G) the active set depends on ``id mod (N/K)`` only: the N experts form N/K
fixed groups of K, so a fine-grained hash layer equals the coarse one with each expert split
into G pieces (the sum of the G piece outputs is the wide expert's output).

Every active gate is exactly 1: a Hash layer's output is the chosen FFN's output, unscaled
(Roller et al. have no gate); for K>1 the gates of 1 make the output the sum of the K expert
outputs, like a MultiHash layer that concatenates the hidden pieces of K hashed sub-FFNs.

The router has **no parameters**: the ``weight`` the :class:`Router` base creates is removed,
so ``num_parameters()`` counts no routing weights for Hash (and DDP sees no unused parameter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from remoe.model.routers.base import Router, RouterContext, Routing, zero


def hash_experts(token_ids_T: Tensor, num_experts: int, k: int) -> Tensor:
    """``[T, K]`` expert indices of each token: ``(id + j * (N // K)) mod N``."""
    stride = num_experts // k
    offsets_K = torch.arange(k, device=token_ids_T.device, dtype=torch.long) * stride
    return torch.remainder(token_ids_T.long().unsqueeze(1) + offsets_K, num_experts)


class HashRouter(Router):
    """Deterministic routing by token id; gates are 1 on the K hashed experts, 0 elsewhere."""

    def __init__(self, d_model: int, num_experts: int, k: int, init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        if not 1 <= k <= num_experts:
            raise ValueError(f"hash routing needs 1 <= k={k} <= num_experts={num_experts}")
        self.k = k
        # No learnable routing: drop the base class's [N, D] weight (keeps the attribute as None).
        del self.weight
        self.register_parameter("weight", None)

    has_router_weights = False
    uses_all_params = False  # DDP: the (absent) router weight never gets a gradient

    @classmethod
    def from_config(cls, cfg) -> "HashRouter":
        r = cfg.routing
        return cls(cfg.d_model, cfg.num_routed, r.num_active, init_std=cfg.init_std)

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        T = x_TD.shape[0]
        ids = ctx.token_ids_T
        if ids is None:
            raise ValueError(
                "model.router=hash routes by token id, but the RouterContext has no token_ids_T: "
                "call the MoE layer with RouterContext(..., token_ids_T=input_ids.reshape(-1)) "
                "(ReMoEForCausalLM passes them)")
        if ids.numel() != T:
            raise ValueError(f"model.router=hash: token_ids_T has {ids.numel()} ids for {T} tokens")
        idx_TK = hash_experts(ids.reshape(-1).to(x_TD.device), self.num_experts, self.k)
        mask_TN = torch.zeros(T, self.num_experts, dtype=torch.bool, device=x_TD.device)
        mask_TN.scatter_(1, idx_TK, True)
        gates_TN = mask_TN.to(torch.float32)
        return Routing(gates_TN, mask_TN, zero(x_TD), zero(x_TD), num_pairs=T * self.k)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, k={self.k}, stride={self.num_experts // self.k}"
