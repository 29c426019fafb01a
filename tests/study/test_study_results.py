"""Result tables from hand-made run directories: seed statistics and the ReLU columns."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from remoe.lab.study.results import inactive_floor, lambda_amplitude, mean_std, write_results
from remoe.lab.study.runs import apply_stop
from remoe.lab.study.spec import load_spec


def _fake_run(runs_dir, run, val, domains, metrics=None):
    d = runs_dir / run.name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(apply_stop(run, runs_dir, 1)))
    (d / "summary.json").write_text(json.dumps({"steps": 10, "tokens": 1000, "flops": 5e9,
                                                "elapsed_s": 2.0, "router": run.config["model"]
                                                ["router"], "val_loss": val}))
    (d / "eval.jsonl").write_text(json.dumps({"step": 10, "val_loss": val, "domains": domains}) + "\n")
    if metrics:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_mean_and_sample_std_over_seeds(write_spec, tmp_path):
    spec = load_spec(write_spec({"seeds": [0, 1, 2], "groups": [
        {"name": "g", "grid": {"model.router": ["topk"]}}]}))
    out = tmp_path / "out"
    for r, v in zip(spec.runs, (4.0, 4.2, 4.6)):
        _fake_run(out / "runs", r, v, {"code": v - 1.0})
    _, md, rows = write_results(spec, out, None)
    assert [r["val_loss"] for r in rows] == [4.0, 4.2, 4.6]
    m, s, n = mean_std([4.0, 4.2, 4.6])
    assert (m, n) == (pytest.approx(4.2666666667), 3)
    assert s == pytest.approx(math.sqrt(((4.0 - m) ** 2 + (4.2 - m) ** 2 + (4.6 - m) ** 2) / 2))
    text = md.read_text()
    assert f"| `topk` | 3/3 | 4.2667 ± {s:.4f} |" in text
    assert f"| {m - 1:.3f} ± {s:.3f} |" in text  # the code domain
    assert mean_std([4.0, None, float("nan")]) == (4.0, None, 1)  # one seed: no spread


@pytest.mark.parametrize("router", ["relu", "relu_threshold"])
def test_relu_columns_from_metrics(router, write_spec, tmp_path):
    """The sparsity-control columns for every run whose sparsity varies: ReMoE's (held by
    lambda) and a threshold router's (no lambda: the same settling step)."""
    spec = load_spec(write_spec({"groups": [{"name": "g", "set": {"model.router": router}}]}))
    run = spec.runs[0]  # micro: 2 layers, E=4, target sparsity 0.75
    metrics = []
    for step in range(1, 41):
        settled = step > 10
        s = 0.75 if settled else 0.3
        metrics.append({"step": step, "flops": 100.0 * step, "sparsity": s,
                        "layer_sparsity": [s - 0.05, s + 0.05] if settled else [s, s],
                        "lambda": 1e-3 * (10.0 if step == 30 else 1.0) if settled else 1e-8,
                        "reg_loss": 1.0, "lm_loss": 5.0, "step_tokens": 64,
                        "dead_experts": [0, 2] if step > 30 else [0, 0],
                        # layer 1, expert 3: no token; expert 2: 3/64, under a quarter of
                        # the fair share 1/4 (4/64): both inactive (by the paper's 1/64 rule
                        # only expert 3)
                        "expert_counts": [[16, 16, 16, 16], [30, 31, 3, 0]]})
    _fake_run(tmp_path / "out" / "runs", run, 4.0, {}, metrics)
    _, md, rows = write_results(spec, tmp_path / "out", None)
    row = rows[0]
    assert row["settle_step"] == 13  # detect_stages: 5-step centred mean, then the band
    assert row["flops_to_settle"] == 1200.0  # FLOPs of steps 1-12
    assert row["layer_sparsity"] == "0.7000/0.8000"
    assert row["layer_dev_max"] == pytest.approx(0.05)
    assert row["settles"] is True
    assert row["lambda_log10_amp"] == pytest.approx(1.0)
    # second half = steps 21-40: the lambda spike at 30 is in it; layer 1 had 2 dead experts
    # in steps 31-40, none before: (0 * 20 + 2 * 10) / 40 layer-steps
    assert row["lambda_log10_amp_late"] == pytest.approx(1.0)
    assert row["dead_per_layer_late"] == pytest.approx(0.5)
    assert (row["inactive_experts"], row["num_experts_total"], row["inactive_source"]) == \
        (2, 8, "expert_counts")
    assert row["inactive_floor"] == 0  # one expert per token in each layer: room for 16
    # expert use: the last 10% of the 40 steps (37-40), every step alike
    load = np.array([30, 31, 3]) / 64
    assert row["use_experts_per_token"] == "1/1"
    assert [float(x) for x in row["use_effective_experts"].split("/")] == pytest.approx(
        [4.0, math.exp(-(load * np.log(load)).sum())], rel=1e-5)
    assert row["use_never_firing"] == "0/1" and row["use_steps"] == "37-40"
    assert "use_no_expert_share" not in row  # no masks recorded
    text = md.read_text()
    assert "Sparsity control" in text and f"| `{run.label}` | 1/1 | 13 | 1.2e+03 |" in text


def test_no_sparsity_control_table_for_a_fixed_k(write_spec, tmp_path):
    spec = load_spec(write_spec({"groups": [{"name": "g", "set": {"model.router": "topk"}}]}))
    metrics = [{"step": i, "flops": 1.0 * i, "sparsity": 0.75, "layer_sparsity": [0.75, 0.75],
                "lambda": 0.0, "reg_loss": 0.0, "lm_loss": 5.0, "step_tokens": 64,
                "expert_counts": [[16, 16, 16, 16], [16, 16, 16, 16]]} for i in range(1, 41)]
    _fake_run(tmp_path / "out" / "runs", spec.runs[0], 4.0, {}, metrics)
    _, md, rows = write_results(spec, tmp_path / "out", None)
    assert rows[0].get("settle_step") is None and "settles" not in rows[0]
    assert "Sparsity control" not in md.read_text()


def test_inactive_floor_counts_what_the_layer_densities_force():
    # layer 0: 32 experts, 20/64 of an expert per token (spread evenly: every one inactive),
    # room for 20 at 1/64 each -> at least 12 inactive; layer 1: one expert per token -> none
    thin = np.full(32, 20 / 64 / 32)
    full = np.full(32, 1 / 32)
    assert inactive_floor(np.stack([thin, full]), 1 / 64) == 12
    # exactly 2/64 in a layer of 4 experts: room for exactly 2 (no rounding loss)
    assert inactive_floor(np.array([[1 / 64, 1 / 64, 0.0, 0.0]]), 1 / 64) == 2
    # a different threshold: 1/8 of the tokens, a = 0.5 -> room for 4 of 8
    assert inactive_floor(np.full((1, 8), 0.5 / 8), threshold=1 / 8) == 4


def test_lambda_amplitude_takes_the_worst_layer():
    recs = [{"step": 1, "lambda": 1.0, "lambda_layers": [1.0, 1.0]},
            {"step": 2, "lambda": 1.0, "lambda_layers": [10.0, 1000.0]},
            {"step": 3, "lambda": 1.0, "lambda_layers": [1.0, 1.0]}]
    assert lambda_amplitude(recs, 1) == pytest.approx(3.0)
    assert lambda_amplitude([{"step": 1, "lambda": 2.0}], 1) is None


def test_expert_use_table_sets_topk_beside_relu_with_seed_spread(write_spec, tmp_path):
    """The "Expert use" table: training counts (last 10% of steps) and the last calibration
    masks, per run (mean ± std over seeds) and layer, TopK rows beside ReLU rows."""
    import torch

    from remoe.train.metrics import write_masks

    spec = load_spec(write_spec({"seeds": [0, 1], "groups": [
        {"name": "g", "grid": {"model.router": ["topk", "relu"]}}]}))  # micro: 2 layers, E=4
    for r in spec.runs:
        relu = r.config["model"]["router"] == "relu"
        counts = [[40, 24, 0, 0], [16, 16, 16, 16]] if relu else [[16, 16, 16, 16]] * 2
        metrics = [{"step": i, "flops": 1.0 * i, "sparsity": 0.75, "layer_sparsity": [0.75] * 2,
                    "lambda": 0.0, "reg_loss": 0.0, "lm_loss": 5.0, "step_tokens": 64,
                    "expert_counts": counts} for i in range(1, 21)]
        _fake_run(tmp_path / "out" / "runs", r, 4.0, {}, metrics)
        m_LTN = torch.zeros(2, 8, 4, dtype=torch.bool)
        m_LTN[:, :, 0] = True  # every token to expert 0
        if relu:  # layer 0: seed 0 leaves 2 of 8 tokens without an expert, seed 1 leaves 4
            m_LTN[0, : 2 + 2 * r.seed, 0] = False
        path = write_masks(tmp_path / "out" / "runs" / r.name, 20, list(m_LTN), torch.arange(8))
        with np.load(path) as z:  # the recorder keeps the share beside the masks
            assert z["no_expert_share"].tolist() == [(2 + 2 * r.seed) / 8 if relu else 0.0, 0.0]
    _, md, rows = write_results(spec, tmp_path / "out", None)
    text = md.read_text()
    table = text[text.index("## Expert use"):]
    assert table.index("`topk`") < table.index("`relu`")  # spec order, both routers
    relu = [r for r in rows if r["label"] == "relu"]
    assert relu[0]["use_no_expert_share"] == "0.25/0" and relu[1]["use_no_expert_share"] == "0.5/0"
    # expert 0 takes every token it can (more than 1/16 of them), the rest none: 3 inactive
    assert relu[0]["use_inactive"] == "3/3"
    assert relu[0]["use_effective_experts"].startswith(f"{math.exp(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375))):.6g}/4")
    assert relu[0]["use_masks"] == "masks@20 (of 4)"
    # layer 0 of relu: 1 expert per token, no-expert share 37.5 ± 17.7 %, 2 never-firing
    assert "| `relu` | 2/2 | 0 | 1.00 ± 0.00 | 1.9 ± 0.0 | 2.0 ± 0.0 | 37.5 ± 17.7 | 3.0 ± 0.0 |" in table
    assert "| `topk` | 2/2 | 0 | 1.00 ± 0.00 | 4.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 3.0 ± 0.0 |" in table
    header = open(tmp_path / "out" / "results.csv").readline().strip().split(",")
    assert header[-1].startswith("use_") and header.index("wall_s") < header.index("use_steps")
