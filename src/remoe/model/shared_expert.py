"""A shared expert: a dense SwiGLU every token uses, added to the routed experts' output.

Legend: T tokens, D model width, S shared expert width.

``y_TD = sigmoid(x_TD w_g) * SwiGLU_S(x_TD)`` with a per-token scalar gate ``w_g`` ``[1, D]``
(Qwen2-MoE's ``shared_expert_gate``), or ``y_TD = SwiGLU_S(x_TD)`` without the gate
(``shared_expert_gate: false``). The MoE layer adds it to the routed output
(``model.shared_expert_size`` > 0; 0, the default, builds nothing). The router never sees it:
sparsity, the L1 control and the load-balancing losses concern the routed experts only, and
every token pays the shared expert's compute (counted by remoe.train.metrics.FlopCounter).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from remoe.model.experts import SwiGLU


class SharedExpert(nn.Module):
    """Parameters: ``ffn.{w_gate,w_up,w_down}.weight`` (a :class:`SwiGLU` of width S) and,
    when gated, ``gate.weight`` ``[1, D]``."""

    def __init__(self, d_model: int, width: int, gated: bool = True,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.ffn = SwiGLU(d_model, width, init_std)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=init_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        y_TD = self.ffn(x_TD)
        if self.gate is None:
            return y_TD
        return torch.sigmoid(self.gate(x_TD)) * y_TD


def build_shared_expert(cfg) -> SharedExpert | None:
    """The shared expert of an MoE layer config (a :class:`remoe.model.moe.MoEConfig`), or
    None when ``shared_expert_size`` is 0."""
    width = cfg.routing.shared_expert_size
    if not width:
        return None
    return SharedExpert(cfg.d_model, width, cfg.routing.shared_expert_gate, cfg.init_std)
