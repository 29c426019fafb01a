"""Penalty-free sparsity control for ReLU-style routing: ``relu_threshold`` (ReLU(x W - theta),
theta steered to each expert's target load) and ``expert_threshold`` (Expert Threshold routing:
EMA thresholds on each expert's score quantile)."""

from __future__ import annotations

import math

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.errors import ConfigError
from remoe.model import registry
from remoe.model.routers import RouterContext
from remoe.model.routers.expert_threshold import ExpertThresholdRouter
from remoe.model.routers.relu_threshold import ReLUThresholdRouter
from remoe.model.routers.thresholds import capacity_quantile

ROUTERS = {"relu_threshold": ReLUThresholdRouter, "expert_threshold": ExpertThresholdRouter}
OPTION = {"relu_threshold": ("threshold_rate", 0.2),
          "expert_threshold": ("threshold_ema_decay", 0.5)}


def _ctx(T):
    return RouterContext(batch_size=1, seq_len=T)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_registered_built_from_config_and_validated(name):
    cls = registry.resolve(name)
    assert cls is ROUTERS[name]
    assert not cls.uses_adaptive_reg  # no lambda controller, no L1 term
    field, value = OPTION[name]
    cfg = ReMoEConfig.from_preset("micro", router=name, granularity=2, **{field: value})
    assert getattr(cfg.routing.options, field) == value
    router = cls.from_config(cfg.moe_config())
    assert router.num_experts == 16 and router.target_density == 1 / 8
    bad = {"threshold_rate": (0.0, -1.0, math.inf), "threshold_ema_decay": (1.0, -0.1, math.nan)}
    for v in bad[field]:
        with pytest.raises(ConfigError, match=rf"^model\.{field}={v!r} must be"):
            ReMoEConfig.from_preset("micro", router=name, **{field: v})
    with pytest.raises(ConfigError, match=rf"^model\.{field}='x' must be of type float"):
        ReMoEConfig.from_preset("micro", router=name, **{field: "x"})


@pytest.mark.parametrize("name", list(ROUTERS))
def test_no_penalty_and_no_controller(name):
    from remoe.method.sparsity import build_controller

    cfg = ReMoEConfig.from_preset("micro", router=name)
    assert build_controller(cfg, cfg.backbone.num_layers) is None
    torch.manual_seed(0)
    model = ReMoEForCausalLM(cfg)
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, labels=ids)
    assert out.aux.reg_loss.item() == 0.0 and out.aux.aux_loss.item() == 0.0
    out.loss.backward()
    for layer in model.layers:  # the gates keep a gradient path to the router
        assert layer.ffn.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(ROUTERS))
def test_thresholds_saved_and_restored(name, tmp_path):
    torch.manual_seed(0)
    field, value = OPTION[name]
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router=name, **{field: value}))
    theta = torch.tensor([0.5, -0.25, 0.0, 0.3, 0.1, -0.1, 0.2, -0.45]) / 4
    router = model.layers[1].ffn.router
    if name == "expert_threshold":
        router.quantile_N.copy_(theta + 0.5)
        router.correction_N.copy_(theta)
        router.threshold_updates.fill_(7)
        theta = router.threshold_N
    else:
        router.threshold_N.copy_(theta)
    model.save_pretrained(tmp_path)
    back = ReMoEForCausalLM.from_pretrained(tmp_path)
    assert getattr(back.config.routing.options, field) == value
    got = back.layers[1].ffn.router
    assert torch.equal(got.threshold_N, theta) and got.threshold_N.dtype == torch.float32
    if name == "expert_threshold":
        assert int(got.threshold_updates) == 7
        assert torch.equal(got.quantile_N, router.quantile_N)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval(), back.eval()
    assert torch.equal(model(ids).logits, back(ids).logits)


def test_relu_threshold_quantile_state_saved_and_restored(tmp_path):
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="relu_threshold",
                                                     threshold_rule="quantile"))
    router = model.layers[0].ffn.router
    router.quantile_N.copy_(torch.linspace(-0.2, 0.3, 8))
    router.correction_N.copy_(torch.linspace(0.1, -0.1, 8))
    router.threshold_N.copy_(router.quantile_N + router.correction_N)
    router.threshold_updates.fill_(5)
    model.save_pretrained(tmp_path)
    back = ReMoEForCausalLM.from_pretrained(tmp_path)
    assert back.config.routing.options.threshold_rule == "quantile"
    got = back.layers[0].ffn.router
    for name in ("quantile_N", "correction_N", "threshold_N", "threshold_updates"):
        assert torch.equal(getattr(got, name), getattr(router, name)), name


def test_relu_threshold_gates_and_update_by_hand():
    r = ReLUThresholdRouter(2, 4, 1 / 4, threshold_rate=0.1)
    with torch.no_grad():
        r.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]))
    # 40 tokens, target 10 per expert: loads 20, 10, 5, 0 -> errors +1, 0, -0.5, -1
    r.after_step(torch.tensor([20.0, 10.0, 5.0, 0.0], dtype=torch.float64), 40)
    assert r.threshold_N.tolist() == pytest.approx([0.1, 0.0, -0.05, -0.1])
    # not centred: all over target -> every threshold rises, the mean with them
    r.after_step(torch.tensor([20.0, 20.0, 20.0, 20.0]), 40)
    assert r.threshold_N.tolist() == pytest.approx([0.2, 0.1, 0.05, 0.0])
    x = torch.tensor([[0.5, -0.1], [-0.1, 0.2]])
    out = r(x, _ctx(2))
    # logits [0.5, -0.1, -0.5, 0.1] and [-0.1, 0.2, 0.1, -0.2], minus the thresholds
    want = torch.relu(torch.tensor([[0.3, -0.2, -0.55, 0.1], [-0.3, 0.1, 0.05, -0.2]]))
    assert torch.allclose(out.gates_TN, want)
    assert torch.equal(out.mask_TN, want > 0)
    assert out.reg_loss.item() == 0.0
    with pytest.raises(ValueError, match="token count"):
        r.after_step(torch.ones(4), None)


def test_relu_threshold_quantile_rule_by_hand():
    """``threshold_rule: quantile``: theta = EMA of the logits' capacity quantile + the load
    correction; its state exists only under that rule (the default's state dict is unchanged)."""
    assert list(ReLUThresholdRouter(2, 2, 1 / 2).state_dict()) == ["weight", "threshold_N"]
    r = ReLUThresholdRouter(2, 2, 1 / 2, threshold_rate=0.1, threshold_rule="quantile",
                            threshold_ema_decay=0.75)
    assert sorted(r.state_dict()) == ["correction_N", "quantile_N", "threshold_N",
                                      "threshold_updates", "weight"]
    with torch.no_grad():
        r.weight.copy_(torch.eye(2))
    x = torch.tensor([[0.9, -0.1], [0.6, 0.4], [-0.3, 0.7], [0.2, 0.8]])
    r.train()
    with torch.enable_grad():
        out = r(x, _ctx(4))
    assert torch.equal(out.gates_TN, torch.relu(x))  # theta 0 before any update
    # C = 2: midpoints of each expert's 2nd and 3rd largest logit: 0.4 and 0.55
    r.after_step(torch.tensor([4.0, 0.0]), 4)  # loads 4 and 0 against 2: errors +1, -1
    assert r.quantile_N.tolist() == pytest.approx([0.4, 0.55])  # the first update replaces
    assert r.correction_N.tolist() == pytest.approx([0.1, -0.1])
    assert r.threshold_N.tolist() == pytest.approx([0.5, 0.45])
    with torch.enable_grad():
        r(x + 1.0, _ctx(4))  # the logits drift up by 1: so does the quantile, in one step
    r.after_step(torch.tensor([2.0, 2.0]), 4)  # on target: the correction stays
    assert r.quantile_N.tolist() == pytest.approx([0.75 * 0.4 + 0.25 * 1.4,
                                                   0.75 * 0.55 + 0.25 * 1.55])
    assert r.threshold_N.tolist() == pytest.approx((r.quantile_N + r.correction_N).tolist())
    r.eval()
    r(x, _ctx(4))  # no quantile from an evaluation forward
    r.after_step(torch.zeros(2), 4)
    assert int(r.threshold_updates) == 2
    with pytest.raises(ConfigError, match=r"^model\.threshold_rule='mean' must be one of load, "
                                          r"quantile$"):
        ReMoEConfig.from_preset("micro", router="relu_threshold", threshold_rule="mean")
    with pytest.raises(ConfigError, match=r"^model\.threshold_ema_decay=1\.0 must be"):
        ReMoEConfig.from_preset("micro", router="relu_threshold", threshold_ema_decay=1.0)


def _skewed(cls, **kw):
    """A router whose expert 0 scores high on most tokens and expert 3 on none."""
    torch.manual_seed(0)
    r = cls(8, 4, 1 / 4, **kw)
    with torch.no_grad():
        r.weight.normal_(std=0.3)
        r.weight[0] = 0.5
        r.weight[3] = -0.5
    return r


def _step(router, x):
    router.train()
    with torch.enable_grad():
        counts_N = router(x, _ctx(x.shape[0])).mask_TN.sum(0).double()
    router.after_step(counts_N, x.shape[0])
    return counts_N


@pytest.mark.parametrize("cls,kw", [(ReLUThresholdRouter, {"threshold_rate": 0.05}),
                                    (ExpertThresholdRouter, {"threshold_ema_decay": 0.5})])
@pytest.mark.kernel_paths  # largest |load - 128| after 200 updates: 0 and 2 on both paths
def test_thresholds_follow_a_load_imbalance(cls, kw):
    r = _skewed(cls, **kw)
    x = torch.rand(512, 8)
    theta0 = r.threshold_N.clone()
    counts0 = _step(r, x)
    assert counts0[0] > 2 * 128 and counts0[3] < 0.5 * 128  # target 128 each
    moved = r.threshold_N - theta0
    assert moved[0] > 0 and moved[3] < 0  # the over-loaded expert's threshold up, starved down
    for _ in range(200):
        counts = _step(r, x)
    # every expert near its target load k T / E = 128, so the layer near sparsity 1 - k/E
    assert (counts - 128).abs().max() < 0.1 * 128, counts
    assert r.threshold_N[0] > r.threshold_N[1:].max() and r.threshold_N[3] < r.threshold_N[:3].min()


def test_expert_threshold_ema_of_the_capacity_quantile():
    s = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]], dtype=torch.float64)
    # C = round(4 * 1/2) = 2: midpoints of the 2nd and 3rd largest score of each expert
    assert capacity_quantile(s, 0.5).tolist() == pytest.approx([0.45, 0.55])
    assert ((s > capacity_quantile(s, 0.5)).sum(0) == 2).all()
    r = ExpertThresholdRouter(2, 2, 1 / 2, threshold_ema_decay=0.75, threshold_rate=0.0)
    assert r.threshold_N.tolist() == [0.5, 0.5]  # 1/N before any update
    r._observe(torch.tensor([0.4, 0.6]))
    r._observe(torch.tensor([0.6, 0.8]))  # two micro-batches: their mean 0.5, 0.7
    r.after_step(torch.zeros(2))
    assert r.threshold_N.tolist() == pytest.approx([0.5, 0.7])  # the first update replaces
    r._observe(torch.tensor([0.9, 0.3]))
    r.after_step(torch.zeros(2))
    assert r.threshold_N.tolist() == pytest.approx([0.75 * 0.5 + 0.25 * 0.9,
                                                    0.75 * 0.7 + 0.25 * 0.3])
    before = r.threshold_N.clone()
    r.after_step(torch.zeros(2))  # a step with no training forward: no update
    assert torch.equal(r.threshold_N, before) and int(r.threshold_updates) == 2
    # the load correction: expert 0 at twice its target (error +1), expert 1 at none (-1)
    c = ExpertThresholdRouter(2, 2, 1 / 2, threshold_ema_decay=0.75, threshold_rate=0.1)
    c.after_step(torch.tensor([20.0, 0.0]), 20)
    assert c.correction_N.tolist() == pytest.approx([0.1, -0.1])
    assert c.threshold_N.tolist() == pytest.approx([0.5 * math.exp(0.1), 0.5 * math.exp(-0.1)])


def test_expert_threshold_routes_each_token_on_its_own():
    """Causal: a token's experts and gates do not depend on the other tokens of the batch, in
    training as at inference (the thresholds come from past steps)."""
    torch.manual_seed(0)
    r = ExpertThresholdRouter(8, 4, 1 / 4)
    r.quantile_N.copy_(torch.tensor([0.3, 0.25, 0.2, 0.28]))
    x = torch.randn(64, 8)
    for training in (True, False):
        r.train(training)
        whole = r(x, _ctx(64))
        alone = [r(x[t:t + 1], _ctx(1)) for t in (0, 17, 63)]
        for t, one in zip((0, 17, 63), alone):
            assert torch.equal(one.mask_TN[0], whole.mask_TN[t])
            assert torch.equal(one.gates_TN[0], whole.gates_TN[t])
        assert whole.mask_TN.sum(1).max() > 1 or whole.mask_TN.sum(1).min() == 0  # variable k
    r._pending = None


#: band around 1 - k/E = 0.875 of the mean sparsity of steps 161-240, per router: 1.5-2x the
#: largest deviation measured over seeds 0-7 under the default kernels and under
#: ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE on an Intel Xeon (AVX-512): load rule
#: 0.842-0.893 (largest deviation 0.033), quantile rule 0.872-0.885 (0.010), expert_threshold
#: 0.867-0.879 (0.008). One trajectory's low bits differ by CPU vendor and kernel path; the
#: band is the controller's spread, not one run's value.
TARGET_BAND = {("relu_threshold", "load"): 0.05, ("relu_threshold", "quantile"): 0.02,
               ("expert_threshold", "load"): 0.02}


@pytest.mark.kernel_paths
@pytest.mark.parametrize("name,kw", [("relu_threshold", {}),
                                     ("relu_threshold", {"threshold_rule": "quantile"}),
                                     ("expert_threshold", {})])
def test_short_training_reaches_the_target_band(name, kw):
    """A micro model trained 240 steps on a fixed synthetic stream, the thresholds updated
    after each optimizer step from the step's counts as the trainer does: the sparsity of the
    last 80 steps averages within the router's band (:data:`TARGET_BAND`) of 1 - k/E = 0.875
    (it starts near 0.5)."""
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", router=name, **kw)
    model = ReMoEForCausalLM(cfg)
    routers = [layer.ffn.router for layer in model.layers]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 512, (64,), generator=g)
    sparsity = []
    for step in range(240):
        ids = (base[torch.randint(0, 64, (8, 33), generator=g)] + step) % 512
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        counts_LN = out.aux.active_counts_LN.detach().double()
        T = ids.numel()
        for router, counts_N in zip(routers, counts_LN):
            router.after_step(counts_N, T)
        sparsity.append(1.0 - float(counts_LN.sum()) / (T * counts_LN.numel()))
    assert sparsity[0] < 0.7
    tail = sum(sparsity[-80:]) / 80
    band = TARGET_BAND[(name, kw.get("threshold_rule", "load"))]
    assert abs(tail - 0.875) < band, (tail, sparsity[-10:])


@pytest.mark.parametrize("name,extra", [("relu_threshold", {}),
                                        ("relu_threshold", {"model.threshold_rule": "quantile"}),
                                        ("expert_threshold", {})])
def test_trainer_resumes_the_thresholds_bit_exactly(name, extra, make_overrides, tmp_path):
    from remoe.experiment import load_config
    from remoe.train.trainer import Trainer

    cfg = load_config(None, make_overrides(tmp_path, name, **{
        "model.router": name, "train.max_steps": 4, "train.eval_every": 0,
        "train.save_every": 0, "analysis.record_masks_every": 0, **extra}))
    t = Trainer(cfg, progress=False)
    assert t.controller is None
    routers = t.token_routers
    theta0 = [r.threshold_N.clone() for r in routers]
    for _ in range(2):
        rec = t.train_step()
        assert rec["reg_loss"] == 0.0 and rec["lambda"] == 0.0
    assert all(not torch.equal(r.threshold_N, th) for r, th in zip(routers, theta0))
    t.save()
    rec = t.train_step()  # step 3 on, after the checkpoint
    after = [r.threshold_N.clone() for r in routers]
    t.metrics.close()
    t.evals.close()
    t.close()
    resumed = Trainer(cfg, resume=True, progress=False)
    assert resumed.step == 2
    again = resumed.train_step()
    assert again["expert_counts"] == rec["expert_counts"] and again["lm_loss"] == rec["lm_loss"]
    for r, want in zip(resumed.token_routers, after):
        assert torch.equal(r.threshold_N, want)
    if extra:  # the quantile rule's own state came back too
        assert all(int(r.threshold_updates) == 3 for r in resumed.token_routers)
    resumed.close()


def _two_rank_worker(rank: int, world: int, root: str) -> None:
    import pathlib

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank,
                            world_size=world)
    try:
        r = ExpertThresholdRouter(2, 2, 1 / 2, threshold_ema_decay=0.5, threshold_rate=0.0)
        # rank 0 saw two micro-batches, rank 1 one: the step's mean is over all three
        for q in ([[0.2, 0.4], [0.4, 0.6]], [[0.9, 0.2]])[rank]:
            r._observe(torch.tensor(q))
        r.after_step(torch.zeros(2), 6)
        want = [(0.2 + 0.4 + 0.9) / 3, (0.4 + 0.6 + 0.2) / 3]
        assert r.quantile_N.tolist() == pytest.approx(want)
        r.after_step(torch.zeros(2), 6)  # no forward on either rank: no update
        assert r.quantile_N.tolist() == pytest.approx(want) and int(r.threshold_updates) == 1
        (pathlib.Path(root) / f"ok-{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_expert_threshold_averages_the_quantiles_over_ranks(tmp_path):
    """Data-parallel ranks fold the same mean quantile in (every rank's thresholds agree)."""
    import torch.multiprocessing as mp

    mp.start_processes(_two_rank_worker, args=(2, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]
