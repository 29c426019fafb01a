"""BlockFFN's router (Song et al. 2025): ``RMSNorm(ReLU(x W))`` over the experts, with its
chunk-level sparsity objectives.

Legend: B sequences, S positions, T = B*S tokens, D model width, N experts (E*G), C chunk length.

Router, as the authors' released pre-training code computes it (``norm_after_router=rms``):

    a_TN = ReLU(x W)                                   # which experts are active: a > 0
    h_TN = a_TN / sqrt(mean_e a_TN^2 + eps)            # RMSNorm over the N experts (eps 1e-5)
    gates_TN = h_TN * w_N                              # w_N: the norm's learned weight, init 1
    p_TN = h_TN / (sum_e h_TN + 1e-5)                  # per-token distribution for the losses

The norm keeps zeros at zero, so the active set is ReLU's. Objectives:

* **Chunk sparsification** (the sparsity term): the probability that an expert is used at least
  once in a chunk of C consecutive tokens, each token using expert e with probability p_te,
  averaged over chunks and experts: ``1 - mean_{chunk, e} prod_{t in chunk} (1 - p_te + 1e-5)``.
  BlockFFN scales it by an adaptive coefficient; here that coefficient is remoe's lambda
  controller, so this is the router's ``reg_loss`` (``uses_adaptive_reg``) and
  ``model.sparsity_control`` / ``model.lambda_update`` steer it to sparsity ``1 - k/E``.
* **Activation locality** (fixed weight ``model.blockffn_locality_coeff``, in ``aux_loss``):
  binary cross-entropy pulling each token's soft activation pattern ``sigmoid(k z_{t-1})`` of the
  previous position towards the current one ``sigmoid(k z_t)``, ``z = x W`` the router logits,
  sharpness k = 100, averaged over adjacent pairs of the same sequence and the experts. Gradient
  flows through both positions, as in the reference code.

docs/BASELINES.md lists what differs from the paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from remoe.model.routers.base import Router, RouterContext, Routing, zero
from remoe.model.routers.options import BlockFFNOptions

RMS_EPS = 1e-5  # the norm's eps: BlockFFN's layer-norm eps (and remoe's rms_norm_eps default)
PROB_EPS = 1e-5  # BlockFFN's eps in p = h / (sum h + eps) and in log(1 - p + eps)
SHARPNESS = 100.0  # BlockFFN's sigmoid steepness in the locality loss


def rms_over_experts(a_TN: Tensor, eps: float = RMS_EPS) -> Tensor:
    """``a / sqrt(mean_e a^2 + eps)``, the mean in at least fp32."""
    ms_T1 = a_TN.to(torch.promote_types(a_TN.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
    return a_TN * torch.rsqrt(ms_T1 + eps).to(a_TN.dtype)


def chunk_sparsification_loss(p_BSN: Tensor, chunk_len: int) -> Tensor:
    """``1 - mean_{chunk, e} prod_{t in chunk} (1 - p_te + 1e-5)``; chunks of ``chunk_len``
    consecutive positions of each sequence. A last, shorter chunk is padded with p = 0 (as
    BlockFFN treats its padding positions)."""
    B, S, N = p_BSN.shape
    if B * S == 0:
        return zero(p_BSN)
    p_BSN = p_BSN.to(torch.promote_types(p_BSN.dtype, torch.float32))
    pad = (-S) % chunk_len
    if pad:
        p_BSN = F.pad(p_BSN, (0, 0, 0, pad))
    log_q_BMN = torch.log(1.0 - p_BSN + PROB_EPS).view(B, -1, chunk_len, N).sum(2)
    return 1.0 - torch.exp(log_q_BMN).mean()


def activation_locality_loss(z_BSN: Tensor, sharpness: float = SHARPNESS) -> Tensor:
    """``BCE(input = sigmoid(k z_{t-1}), target = sigmoid(k z_t))`` over adjacent positions of
    each sequence, mean over pairs and experts (0 when no sequence has two positions)."""
    if z_BSN.shape[1] < 2 or z_BSN.shape[0] == 0:
        return zero(z_BSN)
    prev_BSN, cur_BSN = z_BSN[:, :-1] * sharpness, z_BSN[:, 1:] * sharpness
    return F.binary_cross_entropy_with_logits(prev_BSN, torch.sigmoid(cur_BSN))


class BlockFFNRouter(Router):
    """Gates ``RMSNorm(ReLU(x W)) * w``; reg = chunk sparsification, aux = activation locality."""

    uses_adaptive_reg = True
    options = BlockFFNOptions

    def __init__(self, d_model: int, num_experts: int, chunk_len: int = 64,
                 locality_coeff: float = 2e-3, init_std: float = 0.02) -> None:
        super().__init__(d_model, num_experts, init_std)
        self.norm_weight = nn.Parameter(torch.ones(num_experts))  # the RMSNorm's weight w_N
        self.chunk_len = int(chunk_len)
        self.locality_coeff = float(locality_coeff)

    @classmethod
    def from_config(cls, cfg) -> "BlockFFNRouter":
        o = cfg.options
        return cls(cfg.d_model, cfg.num_routed, o.blockffn_chunk_len,
                   o.blockffn_locality_coeff, init_std=cfg.init_std)

    @classmethod
    def validate_config(cls, cfg, prefix: str = "model.") -> None:
        from remoe.errors import ConfigError

        if cfg.control.revive_after:
            raise ConfigError(f"{prefix}revive_after={cfg.control.revive_after} must be 0 for "
                              f"{prefix}router=blockffn (the revival hinge is the ReLU router's)")

    def forward(self, x_TD: Tensor, ctx: RouterContext) -> Routing:
        z_TN = self.logits(x_TD)
        a_TN = torch.relu(z_TN)
        h_TN = rms_over_experts(a_TN)
        gates_TN = h_TN * self.norm_weight.to(h_TN.dtype)
        mask_TN = a_TN > 0
        T, N = z_TN.shape
        B = ctx.batch_size if ctx.batch_size * ctx.seq_len == T else 1
        p_TN = h_TN / (h_TN.sum(-1, keepdim=True) + PROB_EPS)
        reg = chunk_sparsification_loss(p_TN.view(B, -1, N), self.chunk_len)
        aux = (self.locality_coeff * activation_locality_loss(z_TN.view(B, -1, N))
               if self.locality_coeff else zero(x_TD))
        return Routing(gates_TN, mask_TN, reg, aux)
