"""ThreadTuner: picks the faster thread count by timing steps; thread count never changes numbers."""

import torch

from remoe.machine.threads import ThreadTuner, usable_cores


def test_tuner_probes_both_counts_and_keeps_the_faster():
    t = ThreadTuner(2, probe_every=10, probe_steps=2)
    seen = []
    cost = {2: 1.0, 1: 0.4}  # a shared machine: one thread is faster
    for step in range(25):
        n = t.before_step(step)
        seen.append(n)
        t.after_step(step, cost[n])
    # step 0 exploits (warm-up), steps 1-2 time 2 threads, 3-4 time 1 thread, then 1 is kept
    assert seen[1:5] == [2, 2, 1, 1]
    assert set(seen[5:10]) == {1} and t.decisions[0] == (5, 1)
    cost = {2: 0.3, 1: 0.4}  # the other process ended: the next window switches back
    for step in range(25, 40):
        n = t.before_step(step)
        t.after_step(step, cost[n])
    assert t.current == 2


def test_single_core_tuner_is_inactive_and_omp_num_threads_caps(monkeypatch):
    t = ThreadTuner(1)
    assert not t.active and t.candidates == [1]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert usable_cores() >= 1 and usable_cores(local_world_size=10**6) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert usable_cores() == 1


def test_step_results_do_not_depend_on_the_thread_count():
    from remoe import ReMoEConfig, ReMoEForCausalLM

    torch.manual_seed(0)
    m = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", vocab_size=512, num_experts=8))
    ids = torch.randint(0, 512, (4, 65))
    before = torch.get_num_threads()
    grads = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            m.zero_grad()
            out = m(ids, labels=ids)
            (out.loss + out.aux.reg_loss).backward()
            grads[n] = [out.loss.detach()] + [p.grad.clone() for p in m.parameters()
                                              if p.grad is not None]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(grads[1], grads[2]))
