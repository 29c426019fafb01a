"""``train.fsdp=true`` through ``remoe train`` on gloo: equal to one process step by step, with
expert parallelism equal to plain FSDP, and sharded checkpoints resumed at other world sizes.

Every run uses one sequence per micro-batch (global batch 4 = world x grad_accum), so the
per-micro-batch load-balance weights are computed on the same token groups at every world
size. Each launch has a timeout (run_cmd): a hang fails the test.
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


def test_fsdp_training_resumes_at_any_world_size(make_overrides, tmp_path, run_cmd, free_port):
    def train(name, world, resume=False, **extra):
        o = make_overrides(tmp_path, name, **COMMON,
                           **{"train.grad_accum": 4 // world, **extra})
        cmd = [sys.executable, "-m", "remoe.cli", "train", "--no-progress"]
        if world > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", f"--nproc_per_node={world}",
                        f"--master_port={free_port()}", "-m", "remoe.cli"]
        run_cmd(cmd + (["--resume"] if resume else []) + [f"--set={x}" for x in o])
        return metrics(tmp_path / name / "metrics.jsonl")

    one = train("one", 1)  # the reference: one process, no FSDP, 4 micro-batches
    fsdp = train("fsdp", 2, **{"train.fsdp": "true"})
    fsdp_ep = train("fsdp_ep", 2, **{"train.fsdp": "true", "train.expert_parallel": "true"})
    assert len(one) == len(fsdp) == len(fsdp_ep) == 4
    same_steps(one, fsdp, {1, 2, 3, 4})
    same_steps(fsdp, fsdp_ep, {1, 2, 3, 4})
    assert one[0]["expert_counts"] == fsdp[0]["expert_counts"] == fsdp_ep[0]["expert_counts"]

    for run in ("fsdp", "fsdp_ep"):
        d = tmp_path / run
        # sharded checkpoints; every rank took part in recording the masks; a consolidated
        # final/ (the layout of a run without FSDP) equal to the reference's
        ckpt = d / "checkpoints" / "step_0000004"
        assert (ckpt / "dcp" / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()
        assert sorted(p.name for p in (d / "routing").iterdir()) == [
            "masks_0000000.npz", "masks_0000002.npz", "masks_0000004.npz"]
        from safetensors.torch import load_file

        wa, wb = load_file(str(tmp_path / "one/final/model.safetensors")), load_file(
            str(d / "final/model.safetensors"))
        assert wa.keys() == wb.keys()
        for k in wa:  # (AdamW amplifies fp32 reduction-order noise on near-zero gradients)
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-4, msg=k)
        summary = json.loads((d / "summary.json").read_text())
        assert summary["params_total"] == json.loads(
            (tmp_path / "one/summary.json").read_text())["params_total"]

    # resume the 2-rank runs from step 2 on 1 process and on 4 processes: steps 3-4 continue
    # as the runs that never stopped
    for src, dst, world in (("fsdp_ep", "on1", 1), ("fsdp", "on4", 4)):
        shutil.copytree(tmp_path / src, tmp_path / dst)
        ckpts = tmp_path / dst / "checkpoints"
        shutil.rmtree(ckpts / "step_0000004")
        (ckpts / "LATEST").write_text("step_0000002")
        extra = {"train.fsdp": "true"}
        if src == "fsdp_ep":
            extra["train.expert_parallel"] = "true"
        resumed = train(dst, world, resume=True, **extra)
        assert [r["step"] for r in resumed] == [1, 2, 3, 4]
        same_steps(metrics(tmp_path / src / "metrics.jsonl"), resumed, {3, 4})
