"""TrainBatches (exact resume, data-parallel slicing, epochs) and evaluation batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from remoe.data import ChunkTable, TrainBatches, eval_batches
from remoe.data.sampler import eval_chunk_indices

SEQ = 16


def test_batch_shapes_and_contents(small_bundle):
    tb = small_bundle.train_batches(SEQ, micro_batch=4, grad_accum=2, world_size=1, seed=3)
    x, d = tb.batch(5, 1, 0)
    assert x.shape == (4, SEQ + 1) and x.dtype == torch.int64
    assert d.shape == (4,) and d.dtype == torch.int64
    store = small_bundle.split("train")
    ids = tb.chunk_indices(5, 1, 0)
    for row, c in zip(x, ids):
        off = int(tb.table.offsets[c])
        assert torch.equal(row, torch.from_numpy(np.asarray(store.tokens[off: off + SEQ + 1],
                                                            dtype=np.int64)))
    assert torch.equal(d, torch.from_numpy(tb.table.domain_ids[ids]))


def test_batches_are_a_pure_function_of_indices(small_bundle):
    store = small_bundle.split("train")
    a = TrainBatches(store, SEQ, 3, grad_accum=2, world_size=2, seed=7)
    wanted = [(9, 1, 1), (0, 0, 0), (123, 0, 1), (4000, 1, 0)]  # 4000 is several epochs in
    first = {k: a.batch(*k) for k in wanted}
    b = TrainBatches(store, SEQ, 3, grad_accum=2, world_size=2, seed=7)  # fresh "resumed" run
    for k in reversed(wanted):
        x, d = b.batch(*k)
        assert torch.equal(x, first[k].input_ids) and torch.equal(d, first[k].domain_ids)
    other_seed = TrainBatches(store, SEQ, 3, grad_accum=2, world_size=2, seed=8)
    assert not all(torch.equal(other_seed.batch(*k).input_ids, first[k].input_ids)
                   for k in wanted)


def test_two_ranks_slice_the_single_process_batch(small_bundle):
    store = small_bundle.split("train")
    one = TrainBatches(store, SEQ, micro_batch=4, grad_accum=3, world_size=1, seed=1)
    two = TrainBatches(store, SEQ, micro_batch=2, grad_accum=3, world_size=2, seed=1)
    for step in (0, 1, 17, 250):
        for micro in range(3):
            full = one.batch(step, micro, 0)
            parts = [two.batch(step, micro, r) for r in range(2)]
            assert torch.equal(torch.cat([p.input_ids for p in parts]), full.input_ids)
            assert torch.equal(torch.cat([p.domain_ids for p in parts]), full.domain_ids)
    # and the global batch of a step does not depend on how it is split into micro steps
    accum = TrainBatches(store, SEQ, micro_batch=2, grad_accum=2, world_size=1, seed=1)
    whole = TrainBatches(store, SEQ, micro_batch=4, grad_accum=1, world_size=1, seed=1)
    for step in (0, 3):
        ids = np.concatenate([accum.chunk_indices(step, m) for m in range(2)])
        assert np.array_equal(ids, whole.chunk_indices(step))


def test_epochs_cover_all_chunks_and_reshuffle(small_bundle):
    tb = small_bundle.train_batches(SEQ, micro_batch=1, seed=0)
    n = tb.num_chunks
    epoch0 = np.concatenate([tb.chunk_indices(s) for s in range(n)])
    epoch1 = np.concatenate([tb.chunk_indices(s) for s in range(n, 2 * n)])
    assert sorted(epoch0) == list(range(n)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.arange(n))  # shuffled, not in storage order
    assert tb.epoch(n) == pytest.approx(1.0)


def test_sampler_argument_checks(small_bundle):
    tb = small_bundle.train_batches(SEQ, micro_batch=2, grad_accum=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        tb.batch(0, 0, 2)
    with pytest.raises(ValueError, match="micro_step"):
        tb.batch(0, 2, 0)
    with pytest.raises(ValueError, match="no chunk"):
        small_bundle.train_batches(10**7, micro_batch=1)


def test_eval_batches_cover_every_domain_deterministically(small_bundle):
    b = small_bundle
    runs = [list(b.eval_batches("validation", SEQ, batch_size=5, max_chunks_per_domain=4))
            for _ in range(2)]
    for x, y in zip(*runs):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.domain_ids, y.domain_ids)
    doms = torch.cat([bt.domain_ids for bt in runs[0]])
    assert all(bt.input_ids.shape[0] <= 5 for bt in runs[0])
    counts = torch.bincount(doms, minlength=len(b.domains)).tolist()
    table = b.split("validation").chunks(SEQ)
    for i in range(len(b.domains)):
        assert counts[i] == min(4, int((table.domain_ids == i).sum())) and counts[i] > 0
    all_rows = list(eval_batches(b.split("validation"), SEQ, batch_size=1000))
    assert sum(r.input_ids.shape[0] for r in all_rows) == len(table)


def test_eval_chunks_are_evenly_spaced():
    table = ChunkTable(4, offsets=np.arange(13, dtype=np.int64) * 5,
                       domain_ids=np.array([0] * 10 + [2] * 3, dtype=np.int64))
    assert eval_chunk_indices(table, 3, 4).tolist() == [1, 3, 6, 8, 10, 11, 12]
    assert eval_chunk_indices(table, 3, None).tolist() == list(range(13))
    assert eval_chunk_indices(table, 3, 1).tolist() == [5, 11]
