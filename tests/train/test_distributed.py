"""Two CPU processes (torchrun, gloo) against one process on the same global batch."""

import json

import pytest


def metrics(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_two_processes_match_one(one_vs_two_ranks):
    common = {"train.max_steps": 4, "train.eval_every": 0, "train.save_every": 2,
              "analysis.record_masks_every": 0, "train.num_threads": 1}
    # one process accumulating two micro-batches == two ranks with one micro-batch each (the
    # per-micro-batch load-balance weights f are then computed on the same token groups)
    a, b = one_vs_two_ranks({**common, "train.micro_batch_size": 2}, {"train.grad_accum": 2})
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert rb["step_tokens"] == ra["step_tokens"] == 4 * 33
        assert rb["lm_loss"] == pytest.approx(ra["lm_loss"], rel=1e-4)
        assert rb["reg_loss"] == pytest.approx(ra["reg_loss"], rel=1e-4)
        # sparsity is summed over both ranks before the lambda update: same lambda sequence
        assert rb["sparsity"] == pytest.approx(ra["sparsity"], abs=2e-3)
        assert rb["lambda"] == ra["lambda"]
    # step 1 sees identical weights and data: routing counts agree exactly
    assert a[0]["expert_counts"] == b[0]["expert_counts"]
