"""``blockffn``: BlockFFN's ReLU + RMSNorm router and its chunk-level sparsity objectives."""

import math

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model import registry
from remoe.errors import ConfigError
from remoe.model.routers import RouterContext
from remoe.model.routers.blockffn import (BlockFFNRouter, activation_locality_loss,
                                          chunk_sparsification_loss)

EPS = 1e-5
Z = [[1.0, -1.0, 3.0, 0.0],  # token 0 of the sequence: experts 0 and 2 active
     [2.0, 2.0, -1.0, -3.0],  # token 1: experts 0 and 1
     [-1.0, -2.0, -0.5, -4.0]]  # token 2: no expert


def _router(**kw):
    router = BlockFFNRouter(4, 4, **kw).double()
    with torch.no_grad():
        router.weight.copy_(torch.eye(4, dtype=torch.float64))  # logits = x
    return router


def _hand_h(z):
    """RMSNorm(ReLU(z)) of one token, by hand."""
    a = [max(v, 0.0) for v in z]
    rms = math.sqrt(sum(v * v for v in a) / len(a) + EPS)
    return [v / rms for v in a]


def _hand_p(z):
    h = _hand_h(z)
    s = sum(h) + EPS
    return [v / s for v in h]


def test_gates_are_rms_normalised_relu_values():
    router = _router()
    with torch.no_grad():
        router.norm_weight.copy_(torch.tensor([1.0, 2.0, 0.5, 3.0]))
    x = torch.tensor(Z, dtype=torch.float64)
    r = router(x, RouterContext(batch_size=1, seq_len=3))
    w = [1.0, 2.0, 0.5, 3.0]
    want = [[h * we for h, we in zip(_hand_h(z), w)] for z in Z]
    assert torch.allclose(r.gates_TN, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert r.mask_TN.tolist() == [[True, False, True, False], [True, True, False, False],
                                  [False, False, False, False]]
    assert (r.gates_TN[~r.mask_TN] == 0).all()  # zero exactly where the ReLU is zero
    # the unweighted gates of an active token have root-mean-square 1 over the experts
    h = r.gates_TN[:2] / router.norm_weight
    assert h.pow(2).mean(1).sqrt().tolist() == pytest.approx([1.0, 1.0], rel=1e-5)  # up to eps
    assert math.isfinite(r.reg_loss.item()) and math.isfinite(r.aux_loss.item())


def test_chunk_sparsification_loss_by_hand():
    p = [_hand_p(z) for z in Z]
    p_BSN = torch.tensor([p], dtype=torch.float64)

    def one_minus_mean_prod(chunks):  # chunks: lists of token rows (None = padding, p = 0)
        vals = []
        for chunk in chunks:
            for e in range(4):
                q = 1.0
                for row in chunk:
                    q *= 1.0 - (0.0 if row is None else row[e]) + EPS
                vals.append(q)
        return 1.0 - sum(vals) / len(vals)

    assert chunk_sparsification_loss(p_BSN, 3).item() == pytest.approx(
        one_minus_mean_prod([[p[0], p[1], p[2]]]), rel=1e-12)
    assert chunk_sparsification_loss(p_BSN, 1).item() == pytest.approx(
        one_minus_mean_prod([[p[0]], [p[1]], [p[2]]]), rel=1e-12)
    # 3 positions in chunks of 2: the last chunk is padded with p = 0
    assert chunk_sparsification_loss(p_BSN, 2).item() == pytest.approx(
        one_minus_mean_prod([[p[0], p[1]], [p[2], None]]), rel=1e-12)
    # the router's reg_loss is this loss of its own p
    r = _router(chunk_len=2)(torch.tensor(Z, dtype=torch.float64), RouterContext(1, 3))
    assert r.reg_loss.item() == pytest.approx(one_minus_mean_prod([[p[0], p[1]], [p[2], None]]),
                                              rel=1e-12)
    # the defining property: tokens of a chunk sharing their experts cost less than spreading
    same = torch.tensor([[[1.0, 0, 0, 0], [1.0, 0, 0, 0]]], dtype=torch.float64)
    spread = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]], dtype=torch.float64)
    assert chunk_sparsification_loss(same, 2) < chunk_sparsification_loss(spread, 2)


def test_activation_locality_loss_by_hand():
    z = torch.tensor([Z], dtype=torch.float64) * 0.01  # k z of order 1: no saturation

    def bce(x, y):  # binary cross-entropy of sigmoid(x) against the target y
        s = 1.0 / (1.0 + math.exp(-x))
        return -(y * math.log(s) + (1 - y) * math.log(1 - s))

    k = 100.0
    terms = [bce(k * z[0, t - 1, e].item(), 1.0 / (1.0 + math.exp(-k * z[0, t, e].item())))
             for t in (1, 2) for e in range(4)]
    assert activation_locality_loss(z).item() == pytest.approx(sum(terms) / len(terms), rel=1e-10)
    # pairs never cross sequences: the same 2 tokens as two sequences of one have no pair
    two = torch.tensor([Z[:2]], dtype=torch.float64)
    assert activation_locality_loss(two).item() > 0
    assert activation_locality_loss(two.view(2, 1, 4)).item() == 0.0
    # for a fixed target, the loss is smallest when the previous pattern equals it
    cur = torch.tensor([0.02, -0.03, 0.01, -0.01], dtype=torch.float64)
    same = activation_locality_loss(torch.stack([cur, cur])[None])
    flipped = activation_locality_loss(torch.stack([-cur, cur])[None])
    assert same < flipped
    # the router's aux_loss: coefficient x this loss on its logits, per sequence
    router = _router(locality_coeff=0.5)
    r = router(z[0] / 0.01, RouterContext(batch_size=1, seq_len=3))
    assert r.aux_loss.item() == pytest.approx(0.5 * activation_locality_loss(z / 0.01).item(),
                                              rel=1e-12)
    assert _router(locality_coeff=0.0)(z[0], RouterContext(1, 3)).aux_loss.item() == 0.0


def test_parameters_gradients_and_registration():
    router = _router()
    assert sorted(n for n, _ in router.named_parameters()) == ["norm_weight", "weight"]
    x = torch.tensor(Z, dtype=torch.float64, requires_grad=True)
    r = router(x, RouterContext(1, 3))
    (r.gates_TN.sum() + r.reg_loss + r.aux_loss).backward()
    assert router.norm_weight.grad.abs().sum() > 0 and router.weight.grad.abs().sum() > 0
    cls = registry.resolve("blockffn")
    assert cls is BlockFFNRouter and cls.uses_adaptive_reg and cls.has_router_weights
    cfg = ReMoEConfig.from_preset("micro", router="blockffn", blockffn_chunk_len=16,
                                  blockffn_locality_coeff=1e-3, granularity=2)
    built = cls.from_config(cfg.moe_config())
    assert (built.num_experts, built.chunk_len, built.locality_coeff) == (16, 16, 1e-3)
    assert cfg.uses_adaptive_reg
    # parameters: the micro relu model plus one RMSNorm weight of N per MoE layer
    with torch.device("meta"):
        n_bffn = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="blockffn"))
        n_relu = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="relu"))
    c = n_bffn.config
    assert n_bffn.num_parameters() == (n_relu.num_parameters()
                                       + c.backbone.num_layers * c.routing.num_experts)


@pytest.mark.parametrize("field, value", [("blockffn_chunk_len", 0), ("blockffn_chunk_len", 2.5),
                                          ("blockffn_locality_coeff", -1.0),
                                          ("blockffn_locality_coeff", math.nan),
                                          ("revive_after", 3)])
def test_config_errors(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.{field}="):
        ReMoEConfig.from_preset("micro", router="blockffn", **{field: value})


def _train(make_overrides, tmp_path, name, steps, **extra):
    from remoe.experiment import load_config
    from remoe.train.trainer import Trainer

    cfg = load_config(None, make_overrides(tmp_path, name, **{
        "model.router": "blockffn", "model.blockffn_chunk_len": 8, "train.max_steps": steps,
        "train.eval_every": 0, "train.save_every": 0, "analysis.record_masks_every": 0,
        **extra}))
    t = Trainer(cfg, progress=False)
    recs = [t.train_step() for _ in range(steps)]
    t.close()
    return recs


@pytest.mark.kernel_paths  # measured (Intel Xeon, both kernel paths): sparsity gap 0.237
def test_lambda_controller_steers_the_chunk_loss(make_overrides, tmp_path):
    low = _train(make_overrides, tmp_path, "low", 6, **{"model.lambda0": 1e-8})
    high = _train(make_overrides, tmp_path, "high", 6, **{"model.lambda0": 1.0})
    for recs, lam in ((low, 1e-8), (high, 1.0)):
        for r in recs:  # eq. 6 on the measured sparsity; loss = L_lm + lambda L_cs + L_aux
            assert r["lambda"] == pytest.approx(lam, rel=1e-12)
            assert r["loss"] == pytest.approx(r["lm_loss"] + lam * r["reg_loss"] + r["aux_loss"])
            assert r["reg_loss"] > 0 and r["aux_loss"] > 0
            lam *= 1.2 ** ((1 - 1 / 8 > r["sparsity"]) - (1 - 1 / 8 < r["sparsity"]))
        assert recs[-1]["lm_loss"] < recs[0]["lm_loss"]  # it trains
    assert low[0]["sparsity"] == high[0]["sparsity"]  # same start, then lambda makes it sparser
    assert high[-1]["sparsity"] > low[-1]["sparsity"] + 0.1, (low[-1], high[-1])
    assert high[-1]["reg_loss"] < low[-1]["reg_loss"]


def test_per_layer_control(make_overrides, tmp_path):
    recs = _train(make_overrides, tmp_path, "pl", 2, **{"model.sparsity_control": "per_layer",
                                                         "model.lambda0": 1e-3})
    assert recs[0]["lambda_layers"] == [1e-3, 1e-3] and len(recs[1]["reg_loss_layers"]) == 2
