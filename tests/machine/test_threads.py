"""ThreadTuner (``train.num_threads: auto``): picks the faster thread count by timing steps.

The default fixed count and its resume: tests/reliability/test_thread_count.py."""

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
