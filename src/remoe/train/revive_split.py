"""``model.revive_method: split``: a dead expert becomes a copy of the busiest expert of its layer.

The revival hinge (remoe.model.routers.relu) pulls a dead expert's router row back toward
tokens, but the expert it brings back is untrained, and each revived expert spends part of the
sparsity budget on near-zero gates. Splitting instead puts the dead expert's parameters where
the demand is: at most one dead expert per layer and step (the one silent longest) takes

* the busiest live expert's ``w_in`` and half of its ``w_out`` (the donor keeps the other half),
  so the layer computes the same function for every token of the donor;
* the donor's router row plus Gaussian noise of ``NOISE`` x its RMS, so that the two copies
  receive different tokens and gradients and drift apart;
* the donor's optimizer moments (Adam's ``exp_avg`` / ``exp_avg_sq`` rows, any state tensor
  shaped like the parameter).

The noise is drawn from a generator seeded by (run seed, step, layer): every data-parallel rank
makes the same split and an exact resume repeats it. Every expert's weights must be on every
rank: expert parallel and FSDP refuse this option (remoe.experiment).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the copy's router row = donor's row + NOISE * rms(donor's row) * N(0, 1)
NOISE = 0.1


def pick_split(dead_N: list[bool], silent_N: list[int], counts_N: list[float]
               ) -> tuple[int, int] | None:
    """(dead expert, donor) for one layer, or None: the dead expert silent longest (ties: the
    lowest index) and the live expert with the most tokens this step (ties: the lowest index)."""
    dead = [e for e, d in enumerate(dead_N) if d]
    live = [e for e, d in enumerate(dead_N) if not d and counts_N[e] > 0]
    if not dead or not live:
        return None
    e = max(dead, key=lambda i: (silent_N[i], -i))
    b = max(live, key=lambda i: (counts_N[i], -i))
    return e, b


def _copy_state(optimizer: torch.optim.Optimizer | None, param: Tensor, e: int, b: int) -> None:
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    for v in state.values():
        if torch.is_tensor(v) and v.shape == param.shape:
            v[e].copy_(v[b])


@torch.no_grad()
def split_expert(router_weight_ND: Tensor, w_in_ND2H: Tensor, w_out_NHD: Tensor, e: int, b: int,
                 generator: torch.Generator, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Make expert ``e`` a copy of expert ``b`` in place (parameters and optimizer state)."""
    for p in (router_weight_ND, w_in_ND2H, w_out_NHD):
        _copy_state(optimizer, p, e, b)
    w_in_ND2H[e].copy_(w_in_ND2H[b])
    w_out_NHD[b].mul_(0.5)
    w_out_NHD[e].copy_(w_out_NHD[b])
    row = router_weight_ND[b]
    noise = torch.randn(row.shape, generator=generator, dtype=torch.float32)
    scale = NOISE * row.float().pow(2).mean().sqrt()
    router_weight_ND[e].copy_(row + (scale * noise).to(row.device, row.dtype))


def split_generator(seed: int, step: int, layer: int) -> torch.Generator:
    """The noise generator of one split: the same on every rank and on a resumed run."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + layer)
