"""A run's numbers do not depend on the intra-op thread count (issue 29 item 6).

The thread tuner (``train.num_threads: null``) picks 1 or all cores by timing, so a loaded
machine, or a resume, can run a step at another thread count. MKL's sgemm gives other bits at
2 threads than at 1 for products over a few rows (an expert that received 5-11 tokens); the
fused experts run those on one thread (``remoe.model.fused_cpu.SMALL_MM_ROWS``), and their chunk
size no longer follows the thread count (it decides which experts share a padded product,
which changes the bits too: a 30-step tiny run diverged at step 12 from that). Checked on the
experts alone for every small row count, then through ``remoe train``: 1 vs 2 threads, and a
resume at another thread count, bit for bit.
"""

import shutil

import pytest
import torch

from remoe.cli import main


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _at_threads(n, fn):
    torch.set_num_threads(n)
    return fn()


def test_fused_experts_are_equal_at_1_and_2_threads_for_every_row_count(restore_threads):
    from remoe.model import dispatch
    from remoe.model.fused_cpu import swiglu_fused

    torch.manual_seed(0)
    D, H = 256, 256
    counts = list(range(1, 14)) + [31, 64, 65, 200]  # rows per expert
    N, T = len(counts), max(counts) + 1
    mask = torch.zeros(T, N, dtype=torch.bool)
    for e, c in enumerate(counts):
        mask[torch.randperm(T)[:c], e] = True
    plan = dispatch.plan(mask, on_device=False)
    x = torch.randn(T, D)
    gates = torch.rand(T, N) * mask
    w_in, w_out = torch.randn(N, D, 2 * H) * 0.05, torch.randn(N, H, D) * 0.05

    def step():
        leaves = [t.clone().requires_grad_() for t in (x, gates, w_in, w_out)]
        for max_rows in (64, 4096):  # single-expert chunks and padded groups
            y = swiglu_fused(*leaves, plan, max_rows=max_rows)
            y.square().sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    one, two = _at_threads(1, step), _at_threads(2, step)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_fused_chunking_does_not_follow_the_thread_count(restore_threads):
    """The chunks decide which experts share a padded product (and so the bits of a step)."""
    from remoe.model.fused_cpu import fused_rows

    assert _at_threads(1, lambda: fused_rows(256, 1024)) == _at_threads(
        2, lambda: fused_rows(256, 1024))


SMALL = {"model.hidden_size": 256, "train.max_steps": 4, "train.save_every": 2,
         "train.eval_every": 2, "train.keep_last": 3}


def test_training_is_bit_equal_at_1_and_2_threads_and_across_a_resume(
        tmp_path, train_argv, rd, restore_threads):
    assert main(train_argv(tmp_path, "t1", **SMALL)) == 0
    assert main(train_argv(tmp_path, "t2", **{**SMALL, "train.num_threads": 2})) == 0
    a = rd.strip_timing(rd.read_jsonl(tmp_path / "t1" / "metrics.jsonl"))
    b = rd.strip_timing(rd.read_jsonl(tmp_path / "t2" / "metrics.jsonl"))
    assert len(a) == 4 and a == b
    assert rd.read_jsonl(tmp_path / "t1" / "eval.jsonl") == rd.read_jsonl(
        tmp_path / "t2" / "eval.jsonl")
    assert rd.same_weights(rd.weights(tmp_path / "t1"), rd.weights(tmp_path / "t2"))
    # the 2-thread run resumed from step 2 at 1 thread: the same run
    shutil.copytree(tmp_path / "t2", tmp_path / "r")
    ckpts = tmp_path / "r" / "checkpoints"
    shutil.rmtree(ckpts / "step_0000004")
    (ckpts / "LATEST").write_text("step_0000002")
    assert main(train_argv(tmp_path, "r", "--resume", **SMALL)) == 0
    c = rd.strip_timing(rd.read_jsonl(tmp_path / "r" / "metrics.jsonl"))
    assert c == a
    assert rd.same_weights(rd.weights(tmp_path / "t1"), rd.weights(tmp_path / "r"))
