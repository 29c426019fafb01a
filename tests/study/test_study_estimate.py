"""``remoe study --dry-run``'s cost model (remoe.lab.study.estimate) against real micro runs."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from remoe.cli import main
from remoe.lab.study import estimate
from remoe.lab.study.cli import dry_run
from remoe.lab.study.runner import Study
from remoe.lab.study.spec import load_spec

BASE = {"model": {"preset": "micro", "num_experts": 4},
        "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 4, "warmup_steps": 1,
                  "eval_every": 0, "eval_chunks_per_domain": 1, "save_every": 0, "log_every": 1},
        "analysis": {"record_masks_every": 0}}


def _spec(tmp_path, micro_data_cfg):
    base = json.loads(json.dumps(BASE))
    base["data"] = {"cache_dir": micro_data_cfg.cache_dir, "vocab_size": micro_data_cfg.vocab_size,
                    "max_bytes_per_domain": micro_data_cfg.max_bytes_per_domain}
    spec = {"budget": "two micro runs of 4 steps", "base": base,
            "groups": [{"name": "g", "grid": {"model.router": ["topk", "relu"]}}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_estimate_is_the_trainers_count_and_dry_run_calibrates_on_finished_runs(
        tmp_path, micro_data_cfg):
    path, out = _spec(tmp_path, micro_data_cfg), tmp_path / "out"
    study = Study(load_spec(path), out, log=lambda m: None, jobs=2)
    (topk,) = [r for r in study.spec.runs if r.label == "topk"]
    predicted = estimate.estimate_flops(study.full_config(topk))
    lines: list[str] = []
    before = dry_run(study, log=lines.append, gflops=50.0)
    assert before["runs"] == 2 and before["achieved_gflops"] is None
    assert before["calibrated_wall_s"] is None and not any("finished run" in x for x in lines)
    assert not (out / "runs").exists()  # a dry run trains nothing

    assert main(["study", str(path), "--out", str(out), "--only", "topk", "--no-report"]) == 0
    summary = json.loads((out / "runs/topk-s0/summary.json").read_text())
    # TopK uses k experts from step 1: the estimate is the trainer's own FLOP count, exactly
    assert predicted.steps == summary["steps"] == 4 and predicted.flops == summary["flops"]

    lines.clear()
    after = dry_run(Study(load_spec(path), out, log=lambda m: None, jobs=2), log=lines.append,
                    gflops=50.0)
    text = "\n".join(lines)
    assert any(x.startswith("topk-s0") and " done " in x for x in lines)
    threads = json.loads((out / "runs/topk-s0/metrics.jsonl").read_text().splitlines()[-1])["threads"]
    rate = summary["flops"] / (summary["elapsed_s"] * threads) / 1e9
    assert after["achieved_gflops"] == pytest.approx(rate)
    assert "this study's 1 finished run(s) reached" in text
    (relu,) = [r for r in study.spec.runs if r.label == "relu"]
    cost = estimate.estimate_flops(study.full_config(relu))
    want = ((cost.flops + cost.extra_flops) / (rate * 1e9) + estimate.RUN_OVERHEAD_CPU_S)
    assert after["calibrated_wall_s"] == pytest.approx(want / study.threads)


def test_relu_stage_one_and_caps_in_the_pair_count():
    from remoe.model.config import ReMoEConfig

    def mc(**kw):
        return ReMoEConfig.from_preset("micro", **kw)

    relu = mc(num_experts=8, granularity=2, top_k=1, lambda0=1e-8, alpha=1.2)
    n_dense = estimate.relu_dense_steps(relu)
    assert n_dense == math.ceil(math.log(estimate.RELU_LAMBDA_REF / 1e-8) / math.log(1.2))
    assert estimate.pairs_per_token(relu, 0, n_dense) == 2 * 16 / 2  # N/2 open gates per layer
    assert estimate.pairs_per_token(relu, n_dense, n_dense) == 2 * 2  # k*G after stage I
    capped = mc(num_experts=8, granularity=2, top_k=1, max_active=3)
    assert estimate.pairs_per_token(capped, 0, n_dense) == 2 * 3
    assert estimate.relu_dense_steps(mc(lambda0=1.0)) == 0  # above the reference: no stage I
    assert estimate.relu_dense_steps(mc(router="topk")) == 0
    ec = mc(num_experts=4, top_k=2, router="expert_choice", capacity_factor=1.5)
    assert estimate.pairs_per_token(ec) == 2 * 3.0
    warm = mc(router="topk_warmup", num_experts=8, warmup_k=6, warmup_steps=10)
    assert estimate.pairs_per_token(warm, 3) == 2 * 6 and estimate.pairs_per_token(warm, 10) == 2
    assert estimate.pairs_per_token(mc(router="dense")) == 0.0


def test_achieved_rate_ignores_runs_without_time():
    assert estimate.achieved_rate([]) is None
    assert estimate.achieved_rate([(1e12, 0.0, 1)]) is None
    assert estimate.achieved_rate([(2e12, 100.0, 2), (1e12, 100.0, 1), (5e12, 0.0, 1)]) == \
        pytest.approx(3e12 / 300 / 1e9)
