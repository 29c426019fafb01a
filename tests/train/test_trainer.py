import json
import math

import pytest
import torch
from safetensors.torch import load_file

from remoe import rundir
from remoe.rundir.loading import latest_checkpoint
from remoe.experiment import load_config
from remoe.train.metrics import without_machine_keys as strip_timing
from remoe.train.optim import TrainingDiverged, cosine_lr
from remoe.train.trainer import Trainer


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_metrics_line_per_step_and_lambda_rule(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "m", **{"train.grad_accum": 2}))
    summary = Trainer(cfg, progress=False).train()
    recs = read_jsonl(tmp_path / "m" / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    target, alpha, lam = 1 - 1 / 8, 1.2, 1e-8
    for r in recs:
        # the coefficient used in a step follows eq. 6 from the previous steps' sparsity
        assert r["lambda"] == pytest.approx(lam, rel=1e-12)
        gap = target - r["sparsity"]
        lam *= alpha ** ((gap > 0) - (gap < 0))
        # S_i is the whole step's (both micro-batches) sparsity, from the logged counts
        counts = torch.tensor(r["expert_counts"], dtype=torch.float64)
        L, N = counts.shape
        assert r["step_tokens"] == 2 * 4 * 33
        assert r["sparsity"] == pytest.approx(1 - counts.sum().item() / (L * N * r["step_tokens"]))
        assert r["layer_sparsity"] == pytest.approx((1 - counts.sum(1) / (N * r["step_tokens"])).tolist())
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["lambda"] * r["reg_loss"] + r["aux_loss"])
    assert summary["final_lambda"] == pytest.approx(lam)
    # flops grow by the counted active pairs; validation ran at steps 3 and 6
    assert all(b["flops"] > a["flops"] for a, b in zip(recs, recs[1:]))
    evals = read_jsonl(tmp_path / "m" / "eval.jsonl")
    assert [e["step"] for e in evals] == [3, 6]
    assert set(evals[-1]["domains"]) == {"code", "docs", "encyclopedia", "latex", "prose"}
    masks = sorted((tmp_path / "m" / "routing").glob("masks_*.npz"))
    assert [p.name for p in masks] == [f"masks_{s:07d}.npz" for s in (0, 2, 4, 6)]
    assert (tmp_path / "m" / "final" / "model.safetensors").exists()
    assert (tmp_path / "m" / "final" / "tokenizer.json").exists()


def test_resume_is_bit_exact(make_overrides, tmp_path, train_then_crash):
    ref_cfg = load_config(None, make_overrides(tmp_path, "ref"))
    Trainer(ref_cfg, progress=False).train()

    cfg = load_config(None, make_overrides(tmp_path, "cut"))
    train_then_crash(cfg, 3)  # train 3 steps, checkpoint, then "crash"
    Trainer(cfg, resume=True, progress=False).train()

    ref = strip_timing(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    got = strip_timing(read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert got == ref  # every logged number, bit for bit
    a = load_file(str(tmp_path / "ref" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_keep_last_and_atomic_latest(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "k", **{
        "train.save_every": 1, "train.keep_last": 2}))
    Trainer(cfg, progress=False).train()
    root = tmp_path / "k" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000005", "step_0000006"]
    assert latest_checkpoint(root).name == "step_0000006"
    assert not list(root.glob(".*tmp*"))
    state = rundir.load_state(root / "step_0000006")
    assert state["step"] == 6 and state["controller"]["steps"] == 6


def test_divergence_stops_and_keeps_last_good_checkpoint(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "nan"))
    t = Trainer(cfg, progress=False)
    t._log(t.train_step(), None)
    good = t.save()
    with torch.no_grad():
        t.model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match="non-finite at step 2"):
        t.train_step()
    assert latest_checkpoint(tmp_path / "nan" / "checkpoints") == good
    w = load_file(str(good / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in w.values())


def test_stop_on_tokens_and_flops(make_overrides, tmp_path):
    cfg = load_config(None, make_overrides(tmp_path, "tok", **{
        "train.max_tokens": 3 * 4 * 33, "train.max_steps": 100}))
    s = Trainer(cfg, progress=False).train()
    assert s["steps"] == 3 and "max_tokens" in s["stop_reason"]
    cfg = load_config(None, make_overrides(tmp_path, "fl", **{"train.max_steps": 100}))
    t = Trainer(cfg, progress=False)
    one = t.train_step()["flops"]
    cfg = load_config(None, make_overrides(tmp_path, "fl2", **{
        "train.max_steps": 100, "train.max_flops": 2.5 * one}))
    s = Trainer(cfg, progress=False).train()
    assert "max_flops" in s["stop_reason"] and s["flops"] >= 2.5 * one and s["steps"] <= 4


def test_cosine_schedule():
    assert cosine_lr(0, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert cosine_lr(9, 1.0, 0.1, 10, 100) == pytest.approx(1.0)
    assert cosine_lr(55, 1.0, 0.1, 10, 100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert cosine_lr(100, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert cosine_lr(500, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
