"""``train.fsdp=true`` through ``remoe train`` on gloo: equal to one process step by step, with
expert parallelism equal to plain FSDP, and sharded checkpoints resumed at other world sizes.

Every run uses one sequence per micro-batch (global batch 4 = world x grad_accum), so the
per-micro-batch load-balance weights are computed on the same token groups at every world
size. Each launch has a timeout (run_cmd): a hang fails the test. The default suite trains one
process, FSDP on 2 ranks and resumes that on 1 (FSDP+EP is covered step for step by
test_fsdp_unit.py); the slow test adds FSDP+EP through the trainer and a resume on 4 ranks.
"""

import json
import shutil
import sys

import pytest
import torch

COMMON = {"train.max_steps": 4, "train.eval_every": 0, "train.save_every": 2,
          "train.keep_last": 2, "analysis.record_masks_every": 2, "train.num_threads": 1,
          "train.micro_batch_size": 1}
KEYS_REL = ("lm_loss", "reg_loss", "grad_norm")


def metrics(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def same_steps(a, b, steps):
    for ra, rb in zip(a, b):
        if ra["step"] not in steps:
            continue
        assert rb["step"] == ra["step"] and rb["step_tokens"] == ra["step_tokens"]
        for k in KEYS_REL:  # fp32 sums in another order: equal to ~1e-6
            assert rb[k] == pytest.approx(ra[k], rel=1e-4), (ra["step"], k)
        assert rb["sparsity"] == pytest.approx(ra["sparsity"], abs=2e-3)
        assert rb["lambda"] == pytest.approx(ra["lambda"], rel=1e-9)  # all-reduced statistics


@pytest.fixture
def train(make_overrides, tmp_path, run_cmd, free_port):
    def run(name, world, resume=False, **extra):
        o = make_overrides(tmp_path, name, **COMMON,
                           **{"train.grad_accum": 4 // world, **extra})
        cmd = [sys.executable, "-m", "remoe.cli", "train", "--no-progress"]
        if world > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", f"--nproc_per_node={world}",
                        f"--master_port={free_port()}", "-m", "remoe.cli"]
        run_cmd(cmd + (["--resume"] if resume else []) + [f"--set={x}" for x in o])
        return metrics(tmp_path / name / "metrics.jsonl")
    return run


def check_run(tmp_path, run):
    """Sharded checkpoints; every rank took part in recording the masks; a consolidated final/
    (the layout of a run without FSDP) equal to the one-process reference's."""
    from safetensors.torch import load_file

    d = tmp_path / run
    ckpt = d / "checkpoints" / "step_0000004"
    assert (ckpt / "dcp" / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()
    assert sorted(p.name for p in (d / "routing").iterdir()) == [
        "masks_0000000.npz", "masks_0000002.npz", "masks_0000004.npz"]
    wa, wb = load_file(str(tmp_path / "one/final/model.safetensors")), load_file(
        str(d / "final/model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:  # (AdamW amplifies fp32 reduction-order noise on near-zero gradients)
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-4, msg=k)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["params_total"] == json.loads(
        (tmp_path / "one/summary.json").read_text())["params_total"]


def resume_from_step_2(train, tmp_path, src, dst, world, **extra):
    """Resume ``src`` from its step-2 checkpoint on ``world`` processes: steps 3-4 continue as
    the run that never stopped."""
    shutil.copytree(tmp_path / src, tmp_path / dst)
    ckpts = tmp_path / dst / "checkpoints"
    shutil.rmtree(ckpts / "step_0000004")
    (ckpts / "LATEST").write_text("step_0000002")
    resumed = train(dst, world, resume=True, **{"train.fsdp": "true", **extra})
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    same_steps(metrics(tmp_path / src / "metrics.jsonl"), resumed, {3, 4})


def test_fsdp_training_equals_one_process_and_resumes_on_one(train, tmp_path):
    one = train("one", 1)  # the reference: one process, no FSDP, 4 micro-batches
    fsdp = train("fsdp", 2, **{"train.fsdp": "true"})
    assert len(one) == len(fsdp) == 4
    same_steps(one, fsdp, {1, 2, 3, 4})
    assert one[0]["expert_counts"] == fsdp[0]["expert_counts"]
    check_run(tmp_path, "fsdp")
    resume_from_step_2(train, tmp_path, "fsdp", "on1", 1)


@pytest.mark.slow
def test_fsdp_ep_through_the_trainer_and_resume_on_four(train, tmp_path):
    one = train("one", 1)
    fsdp_ep = train("fsdp_ep", 2, **{"train.fsdp": "true", "train.expert_parallel": "true"})
    assert len(one) == len(fsdp_ep) == 4
    same_steps(one, fsdp_ep, {1, 2, 3, 4})
    check_run(tmp_path, "fsdp_ep")
    resume_from_step_2(train, tmp_path, "fsdp_ep", "ep_on1", 1, **{"train.expert_parallel": "true"})
    resume_from_step_2(train, tmp_path, "fsdp_ep", "on4", 4)
