"""Stacked SwiGLU experts and the expert-compute backends.

Legend: T tokens, P active pairs (rows sorted by expert), R rows of a blocked layout (P plus
padding), D model width, H expert width, N experts.
Weights are stacked 3-D tensors: ``w_in_ND2H`` (gate and up projections side by side) and
``w_out_NHD``. Three backends compute the same thing:

* ``reference``: a Python loop over experts with plain matmuls (readable, any device/dtype);
* ``grouped_mm``: one ``torch.nn.functional.grouped_mm`` per projection over the jagged groups;
* ``fused`` (CPU): :class:`FusedExpertsFn`, one autograd node for gather -> SwiGLU -> gate ->
  scatter-add that never materialises ``[P, D]``. It walks the experts in cache-sized chunks
  (:class:`remoe.model.dispatch.BlockLayout`): tiny or even groups run as one ``torch.bmm`` on
  padded blocks, uneven large groups as one matmul per expert; the gate multiply is fused into
  the ``[R, H]`` activations before the down projection; weight gradients are written in place
  into one buffer (experts without tokens are zero-filled, never recomputed); only ``x`` and the
  ``[R, 2H]`` pre-activations are saved (``recompute=True``: not even those).

``auto`` picks ``fused`` on CPU, ``grouped_mm`` on CUDA bf16 (sm80+) and ``reference`` otherwise.
``measured`` (opt-in, CPU): the faster of ``fused`` and ``grouped_mm`` per shape, timed once and
cached (:mod:`remoe.model.autotune`); not bit-identical to ``auto`` (fp32 agreement ~1e-6).
Keep this module out of ``torch.compile``. See docs/PERFORMANCE.md for the measurements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from remoe.model.autotune import BackendTuner, shape_key
from remoe.model.dispatch import Chunk, Dispatch, pair_gates, permute, unpermute


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
    for n, x_nD in enumerate(x_PD.split(counts_N.tolist())):
        if x_nD.shape[0] == 0:
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


# --------------------------------------------------------------------------- fused CPU backend
#: target bytes of one chunk's gathered rows (x rows + pre-activations): cache-resident
#: (docs/PERFORMANCE.md, chunk sweep); not scaled with the thread count (see fused_rows)
FUSED_CHUNK_BYTES = 4 << 20


#: an expert's product over fewer rows than this runs on one intra-op thread. MKL's sgemm gives
#: other bits at 2 threads than at 1 for a few rows (5-11 rows at D=256 on this machine's
#: AVX2 MKL, issue 29); with them on one thread a step's numbers do not depend on the thread
#: count the tuner picks (remoe.threads), and at one thread nothing changes. Larger products
#: measure equal at 1 and 2 threads (tests/reliability/test_thread_count.py). The same holds
#: for the batched products of padded chunks (a batch of one is a plain product).
SMALL_MM_ROWS = 64


def _mm(a: Tensor, b: Tensor, out: Tensor, rows: int) -> Tensor:
    """``torch.mm`` (``torch.bmm`` for 3-d operands) into ``out``, on one thread when an
    expert's ``rows < SMALL_MM_ROWS``."""
    op = torch.bmm if a.dim() == 3 else torch.mm
    n = torch.get_num_threads()
    if rows >= SMALL_MM_ROWS or n == 1:
        return op(a, b, out=out)
    torch.set_num_threads(1)
    try:
        return op(a, b, out=out)
    finally:
        torch.set_num_threads(n)


def _mm_chunk(a_RK: Tensor, w_NKM: Tensor, ch: Chunk, counts: list[int], out_RM: Tensor,
              transpose_w: bool = False) -> Tensor:
    """``out[rows of e] = a[rows of e] @ W[e]`` (``W[e]^T``) for the experts of one chunk."""
    if ch.r1 == ch.r0:
        return out_RM
    w = w_NKM[ch.e0:ch.e1]
    if transpose_w:
        w = w.transpose(1, 2)
    if ch.padded:
        n = ch.e1 - ch.e0
        _mm(a_RK.view(n, ch.m, -1), w, out_RM.view(n, ch.m, -1), ch.m)
        return out_RM
    r = 0
    for i, e in enumerate(range(ch.e0, ch.e1)):
        c = counts[e]
        if c:
            _mm(a_RK[r:r + c], w[i], out_RM[r:r + c], c)
            r += c
    return out_RM


def _wgrad_chunk(a_RK: Tensor, b_RM: Tensor, ch: Chunk, counts: list[int], dw_NKM: Tensor) -> None:
    """``dW[e] = a[rows of e]^T @ b[rows of e]`` written in place (zeros for idle experts)."""
    if ch.padded:
        n = ch.e1 - ch.e0
        # padding rows carry zero gradients, so they add exact zeros
        _mm(a_RK.view(n, ch.m, -1).transpose(1, 2), b_RM.view(n, ch.m, -1),
            dw_NKM[ch.e0:ch.e1], ch.m)
        return
    r = 0
    for e in range(ch.e0, ch.e1):
        c = counts[e]
        if c:
            _mm(a_RK[r:r + c].t(), b_RM[r:r + c], dw_NKM[e], c)
            r += c
        else:
            dw_NKM[e].zero_()


class FusedExpertsFn(torch.autograd.Function):
    """``y_TD = sum_e gate_te * SwiGLU_e(x_t)`` over the active pairs of a dispatch plan.

    Inputs ``(x_TD, gates_TN, w_in_ND2H, w_out_NHD, plan, max_rows, save_h)``; gradients for the
    first four. Numerically the same computation as ``reference`` (sums may be ordered
    differently inside a matmul).
    """

    @staticmethod
    def forward(ctx, x_TD: Tensor, gates_TN: Tensor, w_in: Tensor, w_out: Tensor,
                plan: Dispatch, max_rows: int, save_h: bool) -> Tensor:
        T, D = x_TD.shape
        N, H = w_out.shape[0], w_out.shape[1]
        lay = plan.layout(max_rows)
        x_TD = x_TD.contiguous()
        flat_P = plan.token_idx_P * N + plan.expert_idx_P  # into gates_TN.view(-1)
        gate_R = x_TD.new_zeros(lay.num_rows)
        gate_R.index_copy_(0, lay.row_P, gates_TN.reshape(-1).index_select(0, flat_P).to(x_TD.dtype))
        y_TD = x_TD.new_zeros(T, D)
        h_R2H = x_TD.new_empty(lay.num_rows, 2 * H) if save_h else None
        rows = max((c.r1 - c.r0 for c in lay.chunks), default=0)
        xg_buf = x_TD.new_empty(rows, D)
        h_buf = None if save_h else x_TD.new_empty(rows, 2 * H)
        for ch in lay.chunks:
            Rc = ch.r1 - ch.r0
            if Rc == 0:
                continue
            tok = lay.tok_R[ch.r0:ch.r1]
            xg = torch.index_select(x_TD, 0, tok, out=xg_buf[:Rc])
            h = h_R2H[ch.r0:ch.r1] if save_h else h_buf[:Rc]
            _mm_chunk(xg, w_in, ch, lay.counts, h)
            z = F.silu(h[:, :H]) * h[:, H:]
            z.mul_(gate_R[ch.r0:ch.r1, None])
            yc = _mm_chunk(z, w_out, ch, lay.counts, xg)  # reuse the gather buffer
            y_TD.index_add_(0, tok, yc)
        ctx.plan, ctx.max_rows, ctx.save_h = plan, max_rows, save_h
        ctx.gates_shape, ctx.gates_dtype = gates_TN.shape, gates_TN.dtype
        ctx.save_for_backward(x_TD, gate_R, flat_P, w_in, w_out,
                              *( [h_R2H] if save_h else []))
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD: Tensor):
        x_TD, gate_R, flat_P, w_in, w_out, *maybe_h = ctx.saved_tensors
        h_R2H = maybe_h[0] if maybe_h else None
        lay = ctx.plan.layout(ctx.max_rows)
        need_x, need_g, need_wi, need_wo = ctx.needs_input_grad[:4]
        dy_TD = dy_TD.contiguous()
        T, D = x_TD.shape
        H = w_out.shape[1]
        dx_TD = torch.zeros_like(x_TD) if need_x else None
        dw_in = torch.empty_like(w_in) if need_wi else None
        dw_out = torch.empty_like(w_out) if need_wo else None
        dgate_R = x_TD.new_zeros(lay.num_rows) if need_g else None
        rows = max((c.r1 - c.r0 for c in lay.chunks), default=0)
        xg_buf, dyg_buf = x_TD.new_empty(rows, D), x_TD.new_empty(rows, D)
        h_buf = x_TD.new_empty(rows, 2 * H) if h_R2H is None else None
        dz_buf, dh_buf = x_TD.new_empty(rows, H), x_TD.new_empty(rows, 2 * H)
        for ch in lay.chunks:
            Rc = ch.r1 - ch.r0
            if Rc == 0:
                for dw in (dw_in, dw_out):
                    if dw is not None:
                        dw[ch.e0:ch.e1].zero_()
                continue
            tok = lay.tok_R[ch.r0:ch.r1]
            xg = torch.index_select(x_TD, 0, tok, out=xg_buf[:Rc])
            if h_R2H is None:
                h = _mm_chunk(xg, w_in, ch, lay.counts, h_buf[:Rc])
            else:
                h = h_R2H[ch.r0:ch.r1]
            hg, hu = h[:, :H], h[:, H:]
            s = F.silu(hg)
            a = s * hu  # un-gated activation
            g = gate_R[ch.r0:ch.r1, None]
            dyg = torch.index_select(dy_TD, 0, tok, out=dyg_buf[:Rc])
            if need_wo:
                _wgrad_chunk(a * g, dyg, ch, lay.counts, dw_out)
            dz = _mm_chunk(dyg, w_out, ch, lay.counts, dz_buf[:Rc], transpose_w=True)
            if need_g:
                torch.sum(dz * a, dim=1, out=dgate_R[ch.r0:ch.r1])
            if not (need_x or need_wi):
                continue
            da = dz.mul_(g)
            dh = dh_buf[:Rc]
            torch.mul(da, s, out=dh[:, H:])
            torch.ops.aten.silu_backward(da.mul_(hu), hg, grad_input=dh[:, :H])
            if need_wi:
                _wgrad_chunk(xg, dh, ch, lay.counts, dw_in)
            if need_x:
                dxg = _mm_chunk(dh, w_in, ch, lay.counts, dyg, transpose_w=True)
                dx_TD.index_add_(0, tok, dxg)
        dgates = None
        if need_g:
            dgates = x_TD.new_zeros(ctx.gates_shape[0] * ctx.gates_shape[1])
            dgates.index_copy_(0, flat_P, dgate_R.index_select(0, lay.row_P))
            dgates = dgates.view(ctx.gates_shape).to(ctx.gates_dtype)
        return dx_TD, dgates, dw_in, dw_out, None, None, None


def fused_rows(d_model: int, d_expert: int, elem: int = 4) -> int:
    """Rows per fused chunk: its gathered inputs + pre-activations fit FUSED_CHUNK_BYTES.

    The same at every thread count (it used to scale with it): the chunks decide which experts
    share a padded product, and so the bits of the result; a budget that followed the thread
    count made a step's numbers depend on the count the tuner picked (issue 29)."""
    return max(64, FUSED_CHUNK_BYTES // (elem * (2 * d_model + 3 * d_expert)))


def swiglu_fused(x_TD: Tensor, gates_TN: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor,
                 plan: Dispatch, recompute: bool = False, max_rows: int | None = None) -> Tensor:
    """Gather -> SwiGLU experts -> gate -> scatter-add in one autograd node (see FusedExpertsFn)."""
    if max_rows is None:
        max_rows = fused_rows(x_TD.shape[1], w_out_NHD.shape[1], x_TD.element_size())
    save_h = torch.is_grad_enabled() and not recompute
    return FusedExpertsFn.apply(x_TD, gates_TN, w_in_ND2H, w_out_NHD, plan, max_rows, save_h)


class SwiGLUExperts(nn.Module):
    """N SwiGLU experts ``y = (silu(x W_g) * (x W_u)) W_o`` stored as stacked weights."""

    def __init__(self, num_experts: int, d_model: int, d_expert: int, init_std: float = 0.02,
                 backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.d_expert = num_experts, d_model, d_expert
        self.backend = backend
        self.recompute = recompute
        self.w_in_ND2H = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_expert))
        self.w_out_NHD = nn.Parameter(torch.empty(num_experts, d_expert, d_model))
        self.init_std = init_std
        self.tuner = BackendTuner() if backend == "measured" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in_ND2H, std=self.init_std)
        nn.init.normal_(self.w_out_NHD, std=self.init_std)

    def resolve_backend(self, x: Tensor) -> str:
        if self.backend == "measured" and x.device.type == "cpu" and grouped_mm_supported(
                x, self.d_expert):
            return "measured"
        if self.backend not in ("auto", "measured"):
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
        w_in, w_out = self.w_in_ND2H, self.w_out_NHD
        if x_TD.dtype != w_in.dtype:  # autocast does not cover grouped_mm / bmm on stacked weights
            w_in, w_out = w_in.to(x_TD.dtype), w_out.to(x_TD.dtype)
        if backend == "measured":
            backend = self._measured(x_TD, gates_TN, w_in, w_out, plan)
        return self._compute(backend, x_TD, gates_TN, w_in, w_out, plan)

    def _compute(self, backend: str, x_TD: Tensor, gates_TN: Tensor, w_in: Tensor, w_out: Tensor,
                 plan: Dispatch) -> Tensor:
        if backend == "fused":
            return swiglu_fused(x_TD, gates_TN, w_in, w_out, plan, recompute=self.recompute)
        x_PD = permute(x_TD, plan)
        y_PD = self.forward(x_PD, plan.counts_N, backend=backend, weights=(w_in, w_out))
        return unpermute(y_PD, pair_gates(gates_TN, plan), plan, x_TD.shape[0])

    def _measured(self, x_TD: Tensor, gates_TN: Tensor, w_in: Tensor, w_out: Tensor,
                  plan: Dispatch) -> str:
        """The tuner's backend for this shape: timed once on detached copies of these inputs
        (forward, plus backward when gradients are on), then remembered."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, gates_TN, w_in))
        key = shape_key(x_TD, self.num_experts, self.d_expert, plan.num_pairs, grad)

        def run(backend: str) -> None:
            args = [t.detach().requires_grad_(grad) for t in (x_TD, gates_TN, w_in, w_out)]
            with torch.set_grad_enabled(grad):
                y = self._compute(backend, *args, plan)
                if grad:
                    y.backward(torch.ones_like(y))

        return self.tuner.choose(key, run)

    def forward(self, x_PD: Tensor, counts_N: Tensor | None = None, backend: str | None = None,
                weights: tuple[Tensor, Tensor] | None = None, *, gates_TN: Tensor | None = None,
                plan: Dispatch | None = None) -> Tensor:
        """``x_PD`` rows grouped by expert with ``counts_N`` rows each -> ``[P, D]`` (unfused).
        ``weights``: ``(w_in, w_out)`` to use instead of the module's (the tuner's copies).
        With ``plan=`` (and ``gates_TN=``): :meth:`forward_tokens` on the token states ``x_PD``
        (how the MoE layer calls experts wrapped by PEFT, whose call applies the adapter)."""
        if plan is not None:
            return self.forward_tokens(x_PD, gates_TN, plan)
        x_PD = autocast_input(x_PD)
        backend = backend or self.resolve_backend(x_PD)
        if backend in ("fused", "measured"):  # jagged rows without a plan: grouped_mm computes them
            backend = "grouped_mm" if grouped_mm_supported(x_PD, self.d_expert) else "reference"
        fn = swiglu_grouped_mm if backend == "grouped_mm" else swiglu_reference
        w_in, w_out = weights or (self.w_in_ND2H, self.w_out_NHD)
        if x_PD.dtype != w_in.dtype:  # autocast does not cover grouped_mm
            w_in, w_out = w_in.to(x_PD.dtype), w_out.to(x_PD.dtype)
        if self.recompute and torch.is_grad_enabled():
            # Keep only the inputs; the [P, 2H] activations are rebuilt in backward. This bounds
            # the memory of ReMoE's dense stages I-II.
            return checkpoint(fn, x_PD, w_in, w_out, counts_N, use_reentrant=False)
        return fn(x_PD, w_in, w_out, counts_N)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_expert={self.d_expert}"


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
