"""Expert parallelism (EP) over the data-parallel group.

Legend: W ranks, r this rank, N experts of a layer (E*G), n = N / W local experts, P active
pairs of this rank (rows sorted by global expert), Q rows this rank's experts receive, D model
width, H expert width.

Rank ``r`` holds experts ``[r*n, (r+1)*n)`` of every MoE layer. :class:`ExpertParallelExperts`
replaces ``MoELayer.experts`` with the same contract ``(x_PD sorted by global expert,
counts_N) -> y_PD``; one call is a collective (every rank calls it, once per MoE layer, in the
same order)::

    counts_N.view(W, n)   --all_to_all-->  counts [source rank, local expert]
    x_PD (grouped by expert, hence by owner rank)  --all_to_all-->  rows [source][local expert]
    regroup by local expert -> SwiGLUExperts on the local weights -> undo the regrouping
    y  --all_to_all back-->  y_PD (this rank's pairs, in the order they came in)

Both row exchanges are differentiable (backward: the reverse exchange), so a local expert's
weight gradient sums the contributions of every rank's tokens. The other parameters are
replicated and averaged by DDP, so :meth:`ExpertParallel.finish_grads` divides the expert
gradients by W: training then equals plain data parallelism (up to summation order).

:class:`ExpertParallel` is the trainer's handle: the DDP parameter names to ignore, the global
gradient norm and clipping, and the conversions between the local slices and the full
(world-size independent) model / optimizer state used by checkpoints.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from remoe.errors import ConfigError
from remoe.model import dispatch
from remoe.model.experts import SwiGLUExperts, autocast_input
from remoe.model.moe import MoELayer

# --------------------------------------------------------------------------- the collective

class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits along dim 0; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = _AllToAll.apply(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return back, None, None, None


def all_to_all_rows(x: Tensor, out_splits: list[int], in_splits: list[int], group=None) -> Tensor:
    """Send ``x``'s rows ``in_splits[j]`` to rank j; receive ``out_splits[j]`` rows from rank j."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _regroup_index(recv_WN: Tensor, total: int | None = None) -> Tensor:
    """Gather index turning rows ordered [source rank][local expert] into [local expert][source].

    ``recv_WN[s, e]``: rows received from rank s for local expert e (int64, on any device);
    ``total``: their sum when the host knows it (then nothing is read back from the device).
    """
    W, n = recv_WN.shape
    dev = recv_WN.device
    flat = recv_WN.reshape(-1)  # source-major blocks, as received
    start = torch.cumsum(flat, 0) - flat  # first row of block (s, e)
    order = torch.arange(W * n, device=dev).view(W, n).t().reshape(-1)  # expert-major blocks
    lens, starts = flat[order], start[order]
    if total is None:
        total = int(flat.sum())
    # row i of the expert-major layout lives at starts[b] + (i - first row of b in that layout)
    shift = starts - (torch.cumsum(lens, 0) - lens)
    return (torch.repeat_interleave(shift, lens, output_size=total)
            + torch.arange(total, device=dev))


# --------------------------------------------------------------------------- the module

def _set_weights(experts: SwiGLUExperts, w_in_ND2H: Tensor, w_out_NHD: Tensor,
                 requires_grad: bool = True) -> None:
    """Give experts built on the meta device (no memory, no RNG draw) their real weights."""
    experts.w_in_ND2H = nn.Parameter(w_in_ND2H, requires_grad=requires_grad)
    experts.w_out_NHD = nn.Parameter(w_out_NHD, requires_grad=requires_grad)
    left = [n for n, t in [*experts.named_parameters(), *experts.named_buffers()] if t.is_meta]
    if left:  # SwiGLUExperts gained state that expert parallelism does not know how to shard
        raise NotImplementedError(f"expert parallelism: SwiGLUExperts.{left[0]} is not handled")


class ExpertParallelExperts(SwiGLUExperts):
    """This rank's slice of a layer's experts, exchanging rows with the other ranks.

    A :class:`SwiGLUExperts` over the ``n = N / W`` local experts (its parameters keep the full
    module's names, ``w_in_ND2H [n, D, 2H]`` and ``w_out_NHD [n, H, D]``), whose ``forward``
    takes the rows of *all* N experts routed on this rank and returns their outputs.
    """

    accepts_padded_plan = False  # the exchange's split sizes are exact pair counts

    def __init__(self, full: SwiGLUExperts, group=None) -> None:
        W, r = dist.get_world_size(group), dist.get_rank(group)
        N = full.num_experts
        if N % W:
            raise ConfigError(f"expert parallelism: {N} experts are not divisible by the world "
                              f"size {W}")
        n = N // W
        with torch.device("meta"):
            super().__init__(n, full.d_model, full.d_expert, full.init_std,
                             backend=full.backend, recompute=full.recompute)
        self.group, self.world_size, self.rank = group, W, r
        self.num_global, self.first_expert = N, r * n
        sl = slice(r * n, (r + 1) * n)
        _set_weights(self, full.w_in_ND2H.detach()[sl].clone(),
                     full.w_out_NHD.detach()[sl].clone(), full.w_in_ND2H.requires_grad)

    def forward(self, x_PD: Tensor, counts_N: Tensor, backend: str | None = None) -> Tensor:
        """``x_PD``: this rank's rows grouped by global expert (``counts_N [N]`` each) -> y_PD."""
        W, n, g = self.world_size, self.num_experts, self.group
        send_WN = counts_N.to(device=x_PD.device, dtype=torch.int64).reshape(W, n).contiguous()
        recv_WN = torch.empty_like(send_WN)
        dist.all_to_all_single(recv_WN, send_WN, group=g)  # [source rank, local expert]
        # the row exchange's split sizes: this call's one device -> host copy
        in_splits, out_splits = torch.stack([send_WN.sum(1), recv_WN.sum(1)]).cpu().tolist()
        x_QD = all_to_all_rows(x_PD, out_splits, in_splits, g)
        idx_Q = _regroup_index(recv_WN, sum(out_splits))  # on the device
        x_local = x_QD.index_select(0, idx_Q)
        if x_local.shape[0]:
            kw = {} if backend is None else {"backend": backend}
            y_local = super().forward(x_local, recv_WN.sum(0), **kw)
        else:
            # no rows for any local expert (grouped_mm cannot backward through zero rows). Stay
            # on the autograd graph so that this rank's backward joins the reverse exchanges
            # of the other ranks; the weights get no gradient (ExpertParallel.finish_grads)
            y_local = x_local * 0.0  # [0, D]
        inv_Q = torch.empty_like(idx_Q)
        inv_Q[idx_Q] = torch.arange(idx_Q.numel(), device=idx_Q.device)
        y_QD = y_local.index_select(0, inv_Q)
        return all_to_all_rows(y_QD, in_splits, out_splits, g)

    def forward_tokens(self, x_TD: Tensor, gates_TN: Tensor, plan: dispatch.Dispatch) -> Tensor:
        """``y_t = sum_e gates_TN[t, e] * SwiGLU_e(x_t)`` over all N experts (see forward)."""
        x_TD = autocast_input(x_TD)  # bf16 autocast: exchange bf16 rows, not the fp32 stream
        x_PD = dispatch.permute(x_TD, plan)
        y_PD = self.forward(x_PD, plan.counts_N)
        gates_P = gates_TN[plan.token_idx_P, plan.expert_idx_P]
        return dispatch.unpermute(y_PD, gates_P, plan, x_TD.shape[0])

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_experts - 1} of "
                f"{self.num_global} (rank {self.rank}/{self.world_size}), "
                f"d_model={self.d_model}, d_expert={self.d_expert}")


# --------------------------------------------------------------------------- the trainer's handle

def _gather_dim0(t: Tensor, group) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


class ExpertParallel:
    """The EP modules of one model, and what training and checkpoints need to know about them."""

    def __init__(self, model: nn.Module, group=None) -> None:
        self.model, self.group = model, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layers: dict[str, ExpertParallelExperts] = {}  # module name -> EP experts
        for name, module in list(model.named_modules()):
            experts = getattr(module, "experts", None)
            if isinstance(module, MoELayer) and type(experts) is SwiGLUExperts:
                ep = ExpertParallelExperts(experts, group)
                module.experts = ep
                self.layers[f"{name}.experts" if name else "experts"] = ep
        if not self.layers:
            raise ConfigError("train.expert_parallel=true: the model has no token-routed MoE layer")
        #: fully qualified parameter name -> local parameter (names as in the full model)
        self.params: dict[str, nn.Parameter] = {
            f"{prefix}.{pname}": p for prefix, mod in self.layers.items()
            for pname, p in mod.named_parameters(recurse=False)}
        self._ids = {id(p) for p in self.params.values()}

    def is_expert_param(self, p: Tensor) -> bool:
        return id(p) in self._ids

    # -- gradients ------------------------------------------------------------------------
    @torch.no_grad()
    def finish_grads(self) -> None:
        """After backward: average the expert gradients like DDP averages the others (1/W).

        A local expert slice that received no row anywhere gets a zero gradient, as its slice of
        the stacked weight has in plain data parallelism (so AdamW updates it the same way).
        """
        for p in self.params.values():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.div_(self.world_size)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[Tensor], max_norm: float) -> Tensor:
        """Global L2 norm (replicated grads once + expert grads of every rank); clip if > 0."""
        params = [p for p in params if p.grad is not None]
        rep = [p.grad for p in params if id(p) not in self._ids]
        exp = [p.grad for p in params if id(p) in self._ids]
        device = params[0].grad.device if params else torch.device("cpu")
        rep_sq, exp_sq = (torch.nn.utils.get_total_norm(g).to(device, torch.float64).reshape(1) ** 2
                          if g else torch.zeros(1, dtype=torch.float64, device=device)
                          for g in (rep, exp))
        dist.all_reduce(exp_sq, group=self.group)
        total = (rep_sq + exp_sq).sqrt().float().reshape(())
        if max_norm > 0 and params:  # (takes the parameters, as clip_grad_norm_ does)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # -- full model <-> local slices --------------------------------------------------------
    def shard_state_dict(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A full model state dict with this rank's slice of every expert weight."""
        out = dict(state)
        for name, p in self.params.items():
            if name in out:
                out[name] = self._slice(out[name], p)
        return out

    def _slice(self, full: Tensor, local: Tensor) -> Tensor:
        n = local.shape[0]
        if full.shape[0] != n * self.world_size or full.shape[1:] != local.shape[1:]:
            raise ConfigError(f"expert parallelism: checkpoint tensor of shape {tuple(full.shape)}"
                              f" does not match {self.world_size} x {tuple(local.shape)}")
        return full[self.rank * n:(self.rank + 1) * n].clone()

    @contextmanager
    def full_experts(self) -> Iterator[None]:
        """Collective: inside, the model holds plain full-size SwiGLUExperts (all experts
        gathered from every rank), e.g. for ``save_pretrained`` or ``num_parameters``."""
        swapped = []
        with torch.no_grad():
            for name, ep in self.layers.items():
                with torch.device("meta"):
                    full = SwiGLUExperts(ep.num_global, ep.d_model, ep.d_expert, ep.init_std,
                                         backend=ep.backend, recompute=ep.recompute)
                _set_weights(full, _gather_dim0(ep.w_in_ND2H.detach(), self.group),
                             _gather_dim0(ep.w_out_NHD.detach(), self.group))
                parent = self.model.get_submodule(name.rpartition(".")[0])
                parent.experts = full
                swapped.append((parent, ep))
        try:
            yield
        finally:
            for parent, ep in swapped:
                parent.experts = ep

    # -- optimizer state ----------------------------------------------------------------------
    def _indexed_params(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: ``optimizer.state_dict()`` with every expert's state gathered (the layout
        of the same model trained without EP; world-size independent)."""
        sd = optimizer.state_dict()
        state = dict(sd["state"])
        for i, p in enumerate(self._indexed_params(optimizer)):
            if id(p) not in self._ids:
                continue
            st = state.get(i)
            has = torch.tensor([st is not None, st is None], device=p.device, dtype=torch.int32)
            dist.all_reduce(has, group=self.group)  # [ranks with state, ranks without]
            if int(has[0]) == 0:
                continue
            if int(has[1]):
                raise RuntimeError("expert parallelism: some ranks have no optimizer state for "
                                   "their experts (call finish_grads before every step)")
            state[i] = {k: (_gather_dim0(v, self.group) if _per_element(v, p) else v)
                        for k, v in st.items()}
        return {**sd, "state": state}

    def shard_optimizer_state(self, sd: dict[str, Any],
                              optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A full optimizer state dict (see :meth:`gather_optimizer_state`) sliced for this rank."""
        state = dict(sd["state"])
        for i, p in enumerate(self._indexed_params(optimizer)):
            if id(p) in self._ids and i in state:
                state[i] = {k: (self._slice(v, p) if isinstance(v, Tensor) and v.ndim > 0
                                and v.shape[1:] == p.shape[1:] else v)
                            for k, v in state[i].items()}
        return {**sd, "state": state}


def _per_element(v: Any, p: Tensor) -> bool:
    return isinstance(v, Tensor) and v.shape == p.shape


def shard_experts(model: nn.Module, group=None) -> ExpertParallel:
    """Replace the experts of every token-routed MoE layer of ``model`` by this rank's slice."""
    return ExpertParallel(model, group)
