"""The layer suite's robust method: rows x rounds in rotated order, paired per-round ratios,
load recorded per measurement (in-process runner: no timing assertions)."""

from __future__ import annotations

from remoe.lab.bench import common, layer


def test_rounds_rotate_rows_and_pair_ratios():
    case = layer.LayerCase(T=64, d_model=16, d_ffn=32, E=4, G=1, k=1, seq_len=64)
    calls = []

    def runner(fn, case_, row, reps, memory, slow_s):
        calls.append((row, memory))
        return fn(case_, row, reps, memory, slow_s)

    rows = layer.run_case(case, reps=1, ceiling_gflops=50.0, rows=("dense", "relu", "topk"),
                          use_cpu=True, log=lambda *_: None, runner=runner, rounds=3)
    order = [r for r, _ in calls]
    assert order == ["dense", "relu", "topk", "relu", "topk", "dense", "topk", "dense", "relu"]
    assert [m for _, m in calls] == [True] * 3 + [False] * 6  # memory pass in round 1 only
    by = {r["row"]: r for r in rows}
    for r in rows:
        assert r["rounds"] == 3 and len(r["cpu_ms_rounds"]) == 3 and len(r["loadavg"]) == 3
        assert len(r["others_busy_cores"]) == 3 and r["peak_mem_mb"] > 0
        assert r["cpu_spread"]["min"] <= r["cpu_ms"] <= r["cpu_spread"]["max"]
    ratios = [a / b for a, b in zip(by["relu"]["cpu_ms_rounds"], by["dense"]["cpu_ms_rounds"])]
    assert abs(by["relu"]["vs_dense_cpu"] - sorted(ratios)[1]) < 1e-3 * by["relu"]["vs_dense_cpu"]
    assert by["dense"]["vs_dense_cpu"] == 1.0
    t = {x["target"]: x for x in layer.layer_targets(rows, "cpu_ms")}
    tk = t["relu / topk at E=4 G=1"]
    assert tk["range"][0] <= tk["value"] <= tk["range"][1] and tk["limit"] == "<= 1.05"
    assert "relu_stage1 / dense_wide at E=4 G=1" not in t  # rows not measured: no target


def test_spread_and_busy_processes():
    s = common.spread([3.0, 1.0, 2.0])
    assert s["median"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0 and s["rel_halfrange"] == 0.5
    assert common.spread([])["n"] == 0
    procs = common.busy_processes(interval_s=0.2, min_share=0.0)
    assert all({"pid", "name", "nice", "cores"} <= set(p) for p in procs)
    m = common.OthersMeter()
    m.start()
    v = m.stop()
    assert v is None or v >= 0.0


def test_stage1_rows_build_dense_wide_and_all_active():
    case = layer.LayerCase(T=64, d_model=16, d_ffn=32, E=4, G=2, k=1, seq_len=64)
    x, ctx, mods = layer.build_rows(case, ("dense_wide", "relu_stage1"))
    assert mods["dense_wide"].ffn.w_up.out_features == 32 * 4
    r = mods["relu_stage1"].router(x.reshape(-1, 16), ctx)
    assert bool(r.mask_TN.all())  # stage I: every expert active for every token
    assert layer.dense_width(case, "dense_wide") == 128 and layer.dense_width(case, "relu") is None


def test_slow_guard_counts_work_not_waiting():
    import time

    def waits():  # a long wall time with no work: a loaded machine, not a slow row
        time.sleep(0.05)

    s = common.time_interleaved({"w": waits}, reps=3, warmup=1, slow_s=0.02)["w"]
    assert len(s.wall_s) == 3  # every round sampled

    def works():
        t0 = time.process_time()
        while time.process_time() - t0 < 0.03:
            pass

    s = common.time_interleaved({"b": works}, reps=3, warmup=1, slow_s=0.02)["b"]
    assert len(s.wall_s) == 1  # really slow: first round only
