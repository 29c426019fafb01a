"""Stacked SwiGLU experts and the expert-compute backends.

Legend: T tokens, P active pairs (rows sorted by expert), R rows of a blocked layout (P plus
padding), D model width, H expert width, N experts.
Weights are stacked 3-D tensors: ``w_in_ND2H`` (gate and up projections side by side) and
``w_out_NHD``. Three backends compute the same thing:

* ``reference``: a Python loop over experts with plain matmuls (readable, any device/dtype);
* ``grouped_mm``: one ``torch.nn.functional.grouped_mm`` per projection over the jagged groups;
* ``fused`` (CPU): one autograd node for gather -> SwiGLU -> gate -> scatter-add that never
  materialises ``[P, D]``, beside the plan it walks (:func:`remoe.model.dispatch.swiglu_fused`).

``auto`` picks ``fused`` on CPU, ``grouped_mm`` on CUDA bf16 (sm80+) and ``reference`` otherwise.
Keep this module out of ``torch.compile``. See docs/PERFORMANCE.md for the measurements.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from remoe.model.dispatch import (Dispatch, mask_padding, pair_gates, permute, swiglu_fused,
                                  unpermute)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: D401
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _grouped(x_PK: Tensor, w_NKM: Tensor, offs_N: Tensor) -> Tensor:
    return _ContiguousGrad.apply(F.grouped_mm(x_PK, w_NKM, offs=offs_N))


def swiglu_grouped_mm(x_PD: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor, counts_N: Tensor) -> Tensor:
    offs_N = counts_N.cumsum(0).to(torch.int32)
    h_P2H = _grouped(x_PD, w_in_ND2H, offs_N)
    gate_PH, up_PH = h_P2H.chunk(2, dim=-1)
    return _grouped((F.silu(gate_PH) * up_PH).contiguous(), w_out_NHD, offs_N)


def swiglu_reference(x_PD: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor, counts_N: Tensor) -> Tensor:
    outs = []
    sizes = counts_N.tolist()
    pad = x_PD.shape[0] - sum(sizes)  # rows of a padded plan past the pairs: zeros out
    for n, x_nD in enumerate(x_PD.split(sizes + [pad])):
        if x_nD.shape[0] == 0:
            continue
        if n == len(sizes):
            outs.append(x_nD.new_zeros(pad, w_out_NHD.shape[-1]))
            continue
        gate, up = (x_nD @ w_in_ND2H[n]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_out_NHD[n])
    if not outs:
        return x_PD.new_zeros(0, w_out_NHD.shape[-1])
    return torch.cat(outs)


def autocast_input(x: Tensor) -> Tensor:
    """``x`` in the autocast dtype when autocast is on for its device (else unchanged).

    Autocast covers ``nn.Linear`` but not ``grouped_mm`` / ``bmm`` on stacked weights, and the
    MoE layer's input is the fp32 residual stream after an RMSNorm: without this the experts
    of a bf16-autocast run would compute in fp32 (on CUDA: not on ``grouped_mm`` at all)."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if x.dtype != dt:
            return x.to(dt)
    return x


def grouped_mm_supported(x: Tensor, width: int) -> bool:
    elem = x.element_size()
    aligned = (x.shape[-1] * elem) % 16 == 0 and (width * elem) % 16 == 0
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    return False


class SwiGLUExperts(nn.Module):
    """N SwiGLU experts ``y = (silu(x W_g) * (x W_u)) W_o`` stored as stacked weights."""

    #: :meth:`forward_tokens` takes a padded dispatch plan (rows masked by ``plan.valid_P``)
    accepts_padded_plan = True

    def __init__(self, num_experts: int, d_model: int, d_expert: int, init_std: float = 0.02,
                 backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.d_expert = num_experts, d_model, d_expert
        self.backend = backend
        self.recompute = recompute
        self.w_in_ND2H = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_expert))
        self.w_out_NHD = nn.Parameter(torch.empty(num_experts, d_expert, d_model))
        self.init_std = init_std
        #: the weights cast for one optimizer step, set by :func:`cast_once_per_step` (else None)
        self.step_weights: tuple[Tensor, Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in_ND2H, std=self.init_std)
        nn.init.normal_(self.w_out_NHD, std=self.init_std)

    def resolve_backend(self, x: Tensor) -> str:
        if self.backend != "auto":
            return self.backend
        if x.device.type == "cpu":
            return "fused"
        return "grouped_mm" if grouped_mm_supported(x, self.d_expert) else "reference"

    def forward_tokens(self, x_TD: Tensor, gates_TN: Tensor, plan: Dispatch) -> Tensor:
        """The whole expert side of an MoE layer: ``y_t = sum_e gates_TN[t, e] * SwiGLU_e(x_t)``.

        ``plan`` groups the active pairs by expert (:func:`remoe.model.dispatch.plan`). Tokens
        without an active expert get exact zeros.
        """
        x_TD = autocast_input(x_TD)
        backend = self.resolve_backend(x_TD)
        w_in, w_out = self.weights_as(x_TD.dtype)
        return self._compute(backend, x_TD, gates_TN, w_in, w_out, plan)

    def weights_as(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(w_in, w_out)`` in ``dtype``: the parameters themselves, the step's cast copies
        (:func:`cast_once_per_step`), or a cast made now (autocast does not cover
        ``grouped_mm`` / ``bmm`` on stacked weights)."""
        w_in, w_out = self.w_in_ND2H, self.w_out_NHD
        if w_in.dtype == dtype:
            return w_in, w_out
        held = self.step_weights
        if held is not None and held[0].dtype == dtype:
            return held
        return w_in.to(dtype), w_out.to(dtype)

    def _compute(self, backend: str, x_TD: Tensor, gates_TN: Tensor, w_in: Tensor, w_out: Tensor,
                 plan: Dispatch) -> Tensor:
        if backend == "fused":
            return swiglu_fused(x_TD, gates_TN, w_in, w_out, plan, recompute=self.recompute)
        # a padded plan (static capacity): its padding rows are zeroed going in and coming out
        x_PD = mask_padding(permute(x_TD, plan), plan)
        y_PD = self.forward(x_PD, plan.row_counts_N, backend=backend, weights=(w_in, w_out))
        return unpermute(mask_padding(y_PD, plan), pair_gates(gates_TN, plan), plan, x_TD.shape[0])

    def forward(self, x_PD: Tensor, counts_N: Tensor | None = None, backend: str | None = None,
                weights: tuple[Tensor, Tensor] | None = None, *, gates_TN: Tensor | None = None,
                plan: Dispatch | None = None) -> Tensor:
        """``x_PD`` rows grouped by expert with ``counts_N`` rows each -> ``[P, D]`` (unfused).
        ``weights``: ``(w_in, w_out)`` to use instead of the module's (cast copies).
        With ``plan=`` (and ``gates_TN=``): :meth:`forward_tokens` on the token states ``x_PD``
        (how the MoE layer calls experts wrapped by PEFT, whose call applies the adapter)."""
        if plan is not None:
            return self.forward_tokens(x_PD, gates_TN, plan)
        x_PD = autocast_input(x_PD)
        backend = backend or self.resolve_backend(x_PD)
        if backend == "fused":  # jagged rows without a plan: grouped_mm computes them
            backend = "grouped_mm" if grouped_mm_supported(x_PD, self.d_expert) else "reference"
        fn = swiglu_grouped_mm if backend == "grouped_mm" else swiglu_reference
        w_in, w_out = weights or self.weights_as(x_PD.dtype)
        if x_PD.dtype != w_in.dtype:
            w_in, w_out = w_in.to(x_PD.dtype), w_out.to(x_PD.dtype)
        if self.recompute and torch.is_grad_enabled():
            # Keep only the inputs; the [P, 2H] activations are rebuilt in backward. This bounds
            # the memory of ReMoE's dense stages I-II.
            return checkpoint(fn, x_PD, w_in, w_out, counts_N, use_reentrant=False)
        return fn(x_PD, w_in, w_out, counts_N)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_expert={self.d_expert}"


@contextmanager
def cast_once_per_step(model: nn.Module, dtype: torch.dtype | None):
    """Cast every :class:`SwiGLUExperts`' weights of ``model`` to ``dtype`` once, on entry,
    for all the forwards and backwards inside (one optimizer step's micro-batches), instead of
    once per micro-batch; the copies are dropped on exit. Gradients reach the fp32 parameters
    through each copy's cast node in every backward, as with a cast per forward, so the step
    is bit-equal; the copies hold ``2 bytes x`` the expert parameters for the step. Enter it
    with gradients enabled, after the optimizer step before it. ``dtype=None`` (fp32) or
    weights already in ``dtype``: nothing to do. Not for FSDP-sharded experts (FSDP's own
    mixed-precision policy casts them when it gathers them)."""
    held = [] if dtype is None else [m for m in model.modules() if isinstance(m, SwiGLUExperts)
                                     and m.w_in_ND2H.dtype != dtype]
    for m in held:
        m.step_weights = (m.w_in_ND2H.to(dtype), m.w_out_NHD.to(dtype))
    try:
        yield
    finally:
        for m in held:
            m.step_weights = None


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN (the dense baseline and the building block of attention blocks)."""

    def __init__(self, d_model: int, d_ffn: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ffn, bias=False)
        self.w_up = nn.Linear(d_model, d_ffn, bias=False)
        self.w_down = nn.Linear(d_ffn, d_model, bias=False)
        for lin in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(lin.weight, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
