"""``revive_method: split``: which expert is split from which, and what the split copies."""

from __future__ import annotations

import pytest
import torch

from remoe import MoEConfig, MoELayer, ReMoEConfig
from remoe.errors import ConfigError
from remoe.experiment import load_config
from remoe.train import control
from remoe.train.control import pick_split, split_expert, split_generator


def test_pick_split_takes_the_longest_silent_dead_expert_and_the_busiest_live_one():
    dead = [False, True, False, True, True]
    silent = [0, 3, 0, 7, 7]
    counts = [10.0, 0.0, 25.0, 0.0, 1.0]
    assert pick_split(dead, silent, counts) == (3, 2)  # silent 7 twice: the lower index
    assert pick_split([False] * 3, [0] * 3, [1.0, 2.0, 3.0]) is None  # nothing dead
    assert pick_split([True, True], [2, 1], [0.0, 0.0]) is None  # no live donor
    # a dead expert with tokens (under the floor) is never a donor
    assert pick_split([True, True, False], [2, 1, 0], [5.0, 9.0, 4.0]) == (0, 2)


def _layer_with_dead_expert(e: int):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig.build(d_model=16, d_ffn=32, num_experts=8, top_k=1, router="relu"))
    with torch.no_grad():
        layer.router.weight[e] = -1.0  # no token with positive features reaches it
    return layer


def test_a_noiseless_split_leaves_the_layer_function_unchanged(monkeypatch):
    e, b = 5, 2
    layer = _layer_with_dead_expert(e)
    x = torch.randn(64, 16).abs()  # router row e is all -1: expert e gets no token
    y0, aux0 = layer(x)
    assert aux0.active_counts_N[e] == 0 and aux0.active_counts_N[b] > 0
    monkeypatch.setattr(control, "NOISE", 0.0)
    split_expert(layer.router.weight, layer.experts.w_in_ND2H, layer.experts.w_out_NHD, e, b,
                 split_generator(0, 0, 0))
    y1, aux1 = layer(x)
    assert aux1.active_counts_N[e] == aux1.active_counts_N[b] == aux0.active_counts_N[b]
    assert torch.allclose(y1, y0, atol=1e-6, rtol=1e-5)
    assert torch.equal(layer.experts.w_in_ND2H[e], layer.experts.w_in_ND2H[b])


def test_split_copies_optimizer_rows_and_draws_the_same_noise_for_the_same_seed():
    e, b = 5, 2
    layers = [_layer_with_dead_expert(e) for _ in range(2)]
    opts, x = [], torch.randn(64, 16)
    for layer in layers:
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        y, aux = layer(x)
        (y.square().mean() + aux.reg_loss).backward()
        opt.step()
        opts.append(opt)
    before = {n: p.detach().clone() for n, p in layers[0].named_parameters()}
    for layer, opt in zip(layers, opts):
        split_expert(layer.router.weight, layer.experts.w_in_ND2H, layer.experts.w_out_NHD, e, b,
                     split_generator(3, 10, 1), opt)
    a, c = layers
    assert torch.equal(a.router.weight, c.router.weight)  # same seed, step, layer: same noise
    w = a.router.weight
    rel = (w[e] - w[b]).pow(2).mean().sqrt() / w[b].pow(2).mean().sqrt()
    assert 0.5 * control.NOISE < rel < 1.5 * control.NOISE
    assert torch.equal(a.experts.w_out_NHD[b], 0.5 * before["experts.w_out_NHD"][b])
    assert torch.equal(a.experts.w_out_NHD[e], a.experts.w_out_NHD[b])
    others = [i for i in range(8) if i not in (e, b)]
    for name, p in a.named_parameters():
        if p.shape[0] == 8:
            assert torch.equal(p[others], before[name][others])  # only e and b change
    for p in (a.router.weight, a.experts.w_in_ND2H, a.experts.w_out_NHD):
        st = opts[0].state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key][e], st[key][b]) and st[key][b].abs().sum() > 0
    g1, g2 = split_generator(3, 11, 1), split_generator(3, 10, 1)
    assert not torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))


def test_revive_method_is_checked_and_split_refuses_sharded_experts():
    with pytest.raises(ConfigError, match="model.revive_method='graft' must be one of hinge, split"):
        ReMoEConfig.from_preset("micro", revive_method="graft")
    for name in ("fsdp", "expert_parallel"):
        with pytest.raises(ConfigError, match=f"model.revive_method=split needs every expert's "
                                              f"weights on every rank; set train.{name}=false"):
            load_config(None, ["model.revive_after=1", "model.revive_method=split",
                               f"train.{name}=true"])
