"""Token order <-> expert order: the dispatch plan, its permute / unpermute primitives, and the
fused CPU expert kernel that walks it.

Legend: T tokens, D model width, H expert width, N experts, P active (token, expert) pairs (or,
in a padded plan, the static capacity C >= P), R rows of a blocked layout (P plus padding).
Only active pairs are ever materialised, so the cost follows P, not T*N (a padded plan: C).

Two consumers of a plan (:func:`plan`):

* the unfused backends (``reference``, ``grouped_mm``) use :func:`permute` / :func:`unpermute`
  on a jagged ``[P, D]`` copy of the inputs;
* the fused CPU backend (:func:`swiglu_fused`: gather -> SwiGLU experts -> gate -> scatter-add
  as one autograd node) never materialises ``[P, D]``. It walks the experts in a
  :class:`BlockLayout`: consecutive runs of experts ("chunks") sized to stay in cache
  (:data:`FUSED_CHUNK_BYTES`), each either *padded* (every expert of the chunk gets the same
  number of rows, so one ``torch.bmm`` covers the chunk) or *jagged* (one matmul per expert, no
  padding). The gate multiply is fused into the ``[R, H]`` activations before the down
  projection; weight gradients are written in place into one buffer (experts without tokens are
  zero-filled, never recomputed); only ``x`` and the ``[R, 2H]`` pre-activations are saved
  (``recompute=True``: not even those). :mod:`remoe.model.experts` calls it for its ``fused``
  backend; nothing else needs the kernel to read the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Dispatch:
    """Where each active (token, expert) pair lives once sorted by expert."""

    token_idx_P: Tensor  # int64 [P]: source token of each pair, grouped by expert
    expert_idx_P: Tensor  # int64 [P]: expert of each pair (non-decreasing)
    counts_N: Tensor  # int64 [N]: pairs per expert (tokens routed to it)
    #: bool [C] of a padded plan (:func:`plan` with ``capacity``): True on the first
    #: ``counts_N.sum()`` rows, the real pairs; the rest are padding rows that point at
    #: (token 0, expert 0) and must be masked (:func:`mask_padding`). None: no padding.
    valid_P: Tensor | None = None
    #: int64 [N] of a padded plan: the rows each expert holds in it -- ``counts_N`` unless the
    #: capacity cut the pairs of the last experts (then they sum to the capacity). What the
    #: expert GEMMs read; None: ``counts_N``
    rows_N: Tensor | None = None
    #: 0-d float of a padded plan: 1 when its pairs did not fit the capacity (then the plan
    #: holds the first ``capacity`` pairs and the layer's output is not exact), else 0
    overflow: Tensor | None = None
    #: per-plan cache of the fused CPU kernel's row layouts (:func:`layout_of`)
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def num_pairs(self) -> int:
        return self.token_idx_P.numel()

    @property
    def row_counts_N(self) -> Tensor:
        """Rows per expert in the plan's layout (what grouped GEMMs take as group sizes)."""
        return self.counts_N if self.rows_N is None else self.rows_N


def plan(mask_TN: Tensor, num_pairs: int | None = None, on_device: bool | None = None,
         capacity: int | None = None) -> Dispatch:
    """Group the active pairs of a boolean ``[T, N]`` mask by expert (tokens ascending inside).

    ``on_device`` (default: the mask is not on the CPU) keeps the plan on the mask's device
    without a host synchronisation:

    * ``num_pairs`` known on the host (fixed-k routers: ``Routing.num_pairs``):
      ``nonzero_static`` of exactly that size, counts by a column sum;
    * else with ``capacity`` (a bound on the pairs: ``T * N``, or a smaller one from the previous
      step's counts): a *padded* plan of ``capacity`` rows -- the real pairs first, then
      padding rows at (token 0, expert 0) -- with ``valid_P`` marking the real ones. Its shapes
      do not depend on the routing, so a compiled block does not recompile when it changes.
      Pairs past the capacity are cut (``rows_N`` then stops at it, so no GEMM reads past the
      plan) and ``overflow`` says so: the caller redoes the step with a larger capacity;
    * else ``nonzero`` reads the pair count back: one synchronisation.

    ``on_device=False`` (the CPU backends, which need the counts on the host anyway) uses
    numpy's ``flatnonzero``. All give the same pairs in the same order.
    """
    T, N = mask_TN.shape
    if on_device is None:
        on_device = mask_TN.device.type != "cpu"
    if not on_device:
        # numpy's flatnonzero on the expert-major copy is ~3x faster than torch.nonzero on CPU
        flat = torch.from_numpy(np.flatnonzero(mask_TN.t().contiguous().numpy()))
        expert_idx, token_idx = flat // max(T, 1), flat % max(T, 1)
        counts_N = torch.bincount(expert_idx, minlength=N)
        return Dispatch(token_idx, expert_idx, counts_N)
    mask_NT = mask_TN.t()
    counts_N = mask_TN.sum(0)  # int64 [N] on the device (bincount would read max() back)
    valid_C = rows_N = overflow = None
    if num_pairs is not None:
        pairs = mask_NT.nonzero_static(size=num_pairs)
    elif capacity is not None:
        pairs = mask_NT.nonzero_static(size=capacity, fill_value=0)
        total = counts_N.sum()
        valid_C = torch.arange(capacity, device=mask_TN.device) < total
        ends_N = counts_N.cumsum(0).clamp(max=capacity)  # the last experts' rows cut at C
        rows_N = torch.diff(ends_N, prepend=ends_N.new_zeros(1))
        overflow = (total > capacity).float()
    else:
        pairs = mask_NT.nonzero()  # [P, 2] as (expert, token), sorted by expert then token
    expert_idx, token_idx = pairs.unbind(1)
    return Dispatch(token_idx, expert_idx, counts_N, valid_C, rows_N, overflow)


def mask_padding(rows_PK: Tensor, d: Dispatch) -> Tensor:
    """Zero the padding rows of a padded plan (identity without padding).

    ``grouped_mm`` leaves the rows past the last offset unwritten (garbage, NaN included), in
    its output and in its backward's input gradient alike; ``where`` keeps them out of both
    directions: the forward passes zeros on, the backward passes a zero gradient back."""
    if d.valid_P is None:
        return rows_PK
    return torch.where(d.valid_P.unsqueeze(1), rows_PK, rows_PK.new_zeros(()))


def permute(x_TD: Tensor, d: Dispatch) -> Tensor:
    """Gather token rows into expert order: ``[T, D] -> [P, D]``."""
    return x_TD.index_select(0, d.token_idx_P)


def unpermute(y_PD: Tensor, weights_P: Tensor, d: Dispatch, num_tokens: int) -> Tensor:
    """Scale each pair's output by its gate and sum back per token: ``[P, D] -> [T, D]``.

    Tokens with no active pair receive exact zeros (the residual path carries them).
    """
    out = y_PD.new_zeros(num_tokens, y_PD.shape[1])
    return out.index_add_(0, d.token_idx_P, y_PD * weights_P.unsqueeze(1).to(y_PD.dtype))


def pair_gates(gates_TN: Tensor, d: Dispatch) -> Tensor:
    """``gates_TN[token_idx_P, expert_idx_P]`` through one flat ``index_select``."""
    flat_P = d.token_idx_P * gates_TN.shape[1] + d.expert_idx_P
    return gates_TN.reshape(-1).index_select(0, flat_P)


# -- the fused CPU expert kernel ---------------------------------------------------------------

@dataclass
class Chunk:
    """A run of experts ``[e0, e1)`` occupying rows ``[r0, r1)`` of a :class:`BlockLayout`.

    ``m > 0``: padded, ``(e1 - e0) x m`` rows (expert ``e`` owns ``r0 + (e - e0) * m ...``);
    ``m == 0``: jagged, expert ``e`` owns its ``counts[e]`` rows in order.
    """

    e0: int
    e1: int
    r0: int
    r1: int
    m: int

    @property
    def padded(self) -> bool:
        return self.m > 0


@dataclass
class BlockLayout:
    """Row layout of the fused expert kernel (see the module docstring)."""

    tok_R: Tensor  # int64 [R]: source token of each row (padding rows: token 0, gate 0)
    row_P: Tensor  # int64 [P]: row of each pair (pairs in Dispatch order)
    chunks: list[Chunk]
    counts: list[int]  # host copy of counts_N
    num_rows: int  # R


def block_layout(d: Dispatch, max_rows: int, pad_limit: float = 1.25, small_group: int = 96,
                 small_pad_limit: float = 2.0) -> BlockLayout:
    """Cut the experts into consecutive chunks of at most ``max_rows`` padded rows.

    Greedy: an expert joins the current chunk while ``(#experts) * max count <= max_rows``
    (a single expert larger than ``max_rows`` gets a chunk of its own). A chunk is padded when
    the padding stays below ``pad_limit`` x its pairs, or below ``small_pad_limit`` x when
    its mean group is under ``small_group`` rows (tiny groups: one ``bmm`` beats a loop of
    tiny matmuls even with padding); otherwise it is jagged.
    """
    counts = d.counts_N.tolist()
    N = len(counts)
    chunks: list[Chunk] = []
    row_start = [0] * N  # first row of each expert
    e0, m, r = 0, 0, 0

    def close(e1: int, m: int) -> None:
        nonlocal r
        if e1 == e0:
            return
        pairs = sum(counts[e0:e1])
        n = e1 - e0
        mean = pairs / n
        padded_rows = n * m
        use_pad = m > 0 and (padded_rows <= pad_limit * pairs
                             or (mean < small_group and padded_rows <= small_pad_limit * pairs))
        if use_pad:
            for i, e in enumerate(range(e0, e1)):
                row_start[e] = r + i * m
            rows = padded_rows
        else:
            acc = r
            for e in range(e0, e1):
                row_start[e] = acc
                acc += counts[e]
            rows = pairs
        chunks.append(Chunk(e0, e1, r, r + rows, m if use_pad else 0))
        r += rows

    for e, c in enumerate(counts):
        new_m = max(m, c)
        if e > e0 and (e - e0 + 1) * new_m > max_rows:
            close(e, m)
            e0, new_m = e, c
        m = new_m
    close(N, m)

    P = d.num_pairs
    device = d.token_idx_P.device
    pair_start = torch.zeros(N, dtype=torch.int64)
    if N > 1:
        pair_start[1:] = d.counts_N.cpu().cumsum(0)[:-1]
    shift_N = (torch.tensor(row_start, dtype=torch.int64) - pair_start).to(device)
    row_P = torch.arange(P, device=device) + shift_N[d.expert_idx_P]
    if r == P:
        tok_R = d.token_idx_P  # no padding anywhere: rows are the pairs
    else:
        tok_R = torch.zeros(r, dtype=torch.int64, device=device)
        tok_R[row_P] = d.token_idx_P
    return BlockLayout(tok_R, row_P, chunks, counts, r)


def layout_of(plan: Dispatch, max_rows: int, pad_limit: float = 1.25, small_group: int = 96,
              small_pad_limit: float = 2.0) -> BlockLayout:
    """The (cached on the plan) :class:`BlockLayout` for chunks of at most ``max_rows`` rows."""
    key = (max_rows, pad_limit, small_group, small_pad_limit)
    if key not in plan._layouts:
        plan._layouts[key] = block_layout(plan, max_rows, pad_limit, small_group, small_pad_limit)
    return plan._layouts[key]


# --------------------------------------------------------------------------- the kernel
#: target bytes of one chunk's gathered rows (x rows + pre-activations): cache-resident
#: (docs/PERFORMANCE.md, chunk sweep); not scaled with the thread count (see fused_rows)
FUSED_CHUNK_BYTES = 4 << 20


#: an expert's product over fewer rows than this runs on one intra-op thread. MKL's sgemm gives
#: other bits at 2 threads than at 1 for a few rows (5-11 rows at D=256 on this machine's
#: AVX2 MKL); with them on one thread, 1 and 2 threads give the same bits on that
#: CPU, and at one thread nothing changes. Not on every CPU: Intel's AVX-512 MKL gives other bits
#: at 2 threads for larger products too, so a run fixes its thread count at its start and a
#: resume reuses it (remoe.machine.threads). The same holds for the batched products of padded
#: chunks (a batch of one is a plain product).
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
        lay = layout_of(plan, max_rows)
        x_TD = x_TD.contiguous()
        flat_P = plan.token_idx_P * N + plan.expert_idx_P  # into gates_TN.view(-1)
        gate_R = x_TD.new_zeros(lay.num_rows)
        gate_P = gates_TN.reshape(-1).index_select(0, flat_P).to(x_TD.dtype)
        gate_R.index_copy_(0, lay.row_P, gate_P)
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
        lay = layout_of(ctx.plan, ctx.max_rows)
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
    count made a step's numbers depend on the count the tuner picked."""
    return max(64, FUSED_CHUNK_BYTES // (elem * (2 * d_model + 3 * d_expert)))


def swiglu_fused(x_TD: Tensor, gates_TN: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor,
                 plan: Dispatch, recompute: bool = False, max_rows: int | None = None) -> Tensor:
    """Gather -> SwiGLU experts -> gate -> scatter-add in one autograd node (see FusedExpertsFn)."""
    if max_rows is None:
        max_rows = fused_rows(x_TD.shape[1], w_out_NHD.shape[1], x_TD.element_size())
    save_h = torch.is_grad_enabled() and not recompute
    return FusedExpertsFn.apply(x_TD, gates_TN, w_in_ND2H, w_out_NHD, plan, max_rows, save_h)
