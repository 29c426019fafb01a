"""Sparsity-control options in real training: per-layer lambda, PI rule, revival."""

import json
import math

import pytest
import torch

from remoe.experiment import load_config
from remoe.train.metrics import without_machine_keys
from remoe.train.trainer import Trainer

OPTIONS = {"model.sparsity_control": "per_layer", "model.lambda_update": "pi",
           "model.revive_after": 1, "model.lambda0": 1e-3, "model.alpha": 2.0}
# an expert under a quarter of the step's tokens starves: splits at every step
SPLIT = {"model.lambda_update": "pi", "model.revive_after": 1, "model.revive_below": 0.25,
         "model.revive_method": "split", "model.lambda0": 1e-3, "model.alpha": 2.0}
BIAS = {"model.lambda_update": "pi", "model.balance_bias_rate": 0.01, "model.lambda0": 1e-3,
        "model.alpha": 2.0}


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_per_layer_pi_lambdas_follow_each_layers_sparsity(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "pl", **OPTIONS))
    Trainer(cfg, progress=False).train()
    recs = read(tmp_path / "pl" / "metrics.jsonl")
    L = len(recs[0]["layer_sparsity"])
    lam, prev = [1e-3] * L, [None] * L
    target_density = 1 / 8
    for r in recs:
        assert r["lambda_layers"] == pytest.approx(lam, rel=1e-12)
        assert r["lambda"] == pytest.approx(sum(lam) / L, rel=1e-12)
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"] + sum(
            a * b for a, b in zip(r["lambda_layers"], r["reg_loss_layers"])) / L)
        assert r["reg_loss"] == pytest.approx(sum(r["reg_loss_layers"]) / L)
        assert r["dead_experts"] == [sum(c == 0 for c in row) for row in r["expert_counts"]]
        assert r["layer_active_k"] == pytest.approx(  # experts per token, per layer
            [sum(row) / r["step_tokens"] for row in r["expert_counts"]], rel=1e-12)
        assert r["effective_experts"] == pytest.approx(  # exp(entropy of the layer's load)
            [math.exp(-sum(c / sum(row) * math.log(c / sum(row)) for c in row if c))
             for row in r["expert_counts"]], rel=1e-9)
        for l, s in enumerate(r["layer_sparsity"]):  # the PI rule, layer by layer
            e = ((1 - s) - target_density) / target_density
            p = e if prev[l] is None else prev[l]
            lam[l] *= 2.0 ** max(-1.0, min(1.0, 1.0 * (e - p) + 1.0 * e))  # default ki = 1
            prev[l] = e
        assert r["reviving"] == [sum(c == 0 for c in row) for row in r["expert_counts"]]


@pytest.mark.parametrize("options", [OPTIONS, SPLIT, BIAS],
                         ids=["per_layer_pi_hinge", "pi_split", "pi_balance_bias"])
def test_options_resume_bit_exact(make_overrides, tmp_path, train_then_crash, options):
    Trainer(load_config(None, make_overrides(tmp_path, "ref", **options)), progress=False).train()
    cfg = load_config(None, make_overrides(tmp_path, "cut", **options))
    train_then_crash(cfg, 3)
    Trainer(cfg, resume=True, progress=False).train()
    ref = without_machine_keys(read(tmp_path / "ref" / "metrics.jsonl"))
    got = without_machine_keys(read(tmp_path / "cut" / "metrics.jsonl"))
    assert got == ref


def test_balance_bias_follows_the_logged_loads(make_overrides, tmp_path):
    from remoe.model.routers.base import bias_update

    cfg = load_config(None, make_overrides(tmp_path, "bias", **BIAS))
    t = Trainer(cfg, progress=False)
    t.train()
    recs = read(tmp_path / "bias" / "metrics.jsonl")
    for layer, router in enumerate(t.token_routers):  # the sum of each step's centred sign step
        want = sum(bias_update(torch.tensor(r["expert_counts"][layer]), 0.01) for r in recs)
        assert torch.allclose(router.expert_bias_N.double(), want, atol=1e-6)
        assert router.expert_bias_N.abs().sum() > 0


@pytest.mark.kernel_paths  # 4 splits in 6 steps under both kernel paths (Intel Xeon)
def test_split_turns_a_starving_expert_into_a_copy_of_the_busiest(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "split", **SPLIT))
    t = Trainer(cfg, progress=False)
    splits = 0
    for _ in range(cfg.train.max_steps):
        rec = t.train_step()
        floor = 0.25 * rec["step_tokens"]
        for layer, (n, counts) in enumerate(zip(rec["split"], rec["expert_counts"])):
            starving = [e for e, c in enumerate(counts) if c <= floor]
            assert n == int(bool(starving) and len(starving) < len(counts))
            if n:  # the longest-silent starving expert now holds the busiest one's w_in
                experts = t.control.experts[layer]
                b = max(range(len(counts)), key=lambda i: (counts[i], -i))
                copies = [e for e in starving
                          if torch.equal(experts.w_in_ND2H[e], experts.w_in_ND2H[b])]
                assert len(copies) == 1
                splits += 1
    assert splits > 0
    t.metrics.close()
    t.evals.close()


def test_per_layer_lambda_identical_on_two_ranks(one_vs_two_ranks):
    common = {**OPTIONS, "train.max_steps": 4, "train.eval_every": 0, "train.save_every": 2,
              "analysis.record_masks_every": 0, "train.num_threads": 1,
              "train.micro_batch_size": 2}
    # every save all-reduces each layer's lambda and fails if the ranks disagree
    a, b = one_vs_two_ranks(common, {"train.grad_accum": 2})
    assert len(a) == len(b) == 4
    assert a[0]["lambda_layers"] == b[0]["lambda_layers"]
    for ra, rb in zip(a[:2], b[:2]):  # per-layer sparsities summed over ranks: same lambdas
        assert rb["lambda_layers"] == pytest.approx(ra["lambda_layers"], rel=1e-9)


def test_balance_bias_identical_on_two_ranks(one_vs_two_ranks, tmp_path):
    from safetensors.torch import load_file

    common = {**BIAS, "train.max_steps": 4, "train.eval_every": 0, "train.save_every": 2,
              "analysis.record_masks_every": 0, "train.num_threads": 1,
              "train.micro_batch_size": 2}
    # the offsets move on the step's counts summed over ranks: the same as one process
    a, b = one_vs_two_ranks(common, {"train.grad_accum": 2})
    assert [r["expert_counts"] for r in a] == [r["expert_counts"] for r in b]
    one, two = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("one", "two"))
    keys = [k for k in one if k.endswith("router.expert_bias_N")]
    assert keys and all(torch.equal(one[k], two[k]) for k in keys)
    assert any(one[k].abs().sum() > 0 for k in keys)


def test_analyze_stages_draws_and_measures_each_layers_lambda(make_overrides, tmp_path):
    from remoe.lab.analysis.analyze import Options, analyze_stages
    from remoe.lab.analysis.runlog import Run

    Trainer(load_config(None, make_overrides(tmp_path, "a", **OPTIONS)), progress=False).train()
    out = tmp_path / "analysis"
    out.mkdir()
    rec = analyze_stages(Run(tmp_path / "a"), out, Options())
    stored = json.loads((out / "stages.json").read_text())
    assert "lambda_log10_amplitude_stage3" in stored
    L = len(read(tmp_path / "a" / "metrics.jsonl")[0]["lambda_layers"])
    assert len(stored["lambda_layers_log10_amplitude_stage3"]) == L
    assert (out / "stages.png").stat().st_size > 10_000 and rec["files"]
