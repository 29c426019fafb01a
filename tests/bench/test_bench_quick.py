"""`remoe bench --quick` runs end to end and writes the expected JSON (no timing assertions)."""

from __future__ import annotations

import json
import math

from remoe.lab.bench import cli


def test_quick_all_suites_write_expected_json(tmp_path, capfd):
    out = tmp_path / "quick.json"
    assert cli.main(["--suite", "all", "--quick", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "remoe-bench/1" and res["quick"] is True
    assert "smoke run" in res["note"]
    m = res["machine"]
    for key in ("cpu_model", "cores_logical", "torch", "threads", "transformers", "allocator"):
        assert key in m
    assert m["threads"] == 1
    # the load beside the run is recorded
    assert isinstance(m["busy_processes_start"], list) and isinstance(m["busy_processes_end"], list)
    assert res["layer_method"]["rounds"] == 1 and res["layer_method"]["reps"] == 2
    assert res["machine_ceiling"]["matmul_fp32_gflops"] > 0

    rows = res["layer"]["rows"]
    names = {r["row"] for r in rows}
    assert names == {"dense", "relu", "topk", "relu_unfused", "hf_eager", "hf_grouped_mm"}
    for r in rows:
        for key in ("case", "E", "G", "k", "T", "wall_ms", "cpu_ms", "vs_dense", "gflops", "mfu",
                    "peak_mem_mb"):
            assert key in r, key
        assert r["wall_ms"] > 0 and r["peak_mem_mb"] > 0
        assert r["rounds"] == 1 and len(r["cpu_ms_rounds"]) == 1 and len(r["loadavg"]) == 1
    relu = [r for r in rows if r["row"] == "relu"]
    # the forced steady state: sparsity exactly 1 - k/E, every expert T k / E tokens
    for r in relu:
        assert math.isclose(r["sparsity"], 1 - r["k"] / r["E"], abs_tol=1e-9)
        assert r["tokens_per_expert_min"] == r["tokens_per_expert_max"] == r["T"] * r["k"] // r["E"]
    assert all({"target", "value", "limit", "met"} <= set(t) for t in res["layer"]["targets"])

    mod = res["model"]
    assert {r["row"] for r in mod["throughput"]} == {"dense", "topk", "relu"}
    for r in mod["throughput"]:
        assert r["train_tokens_per_s"] > 0 and r["infer_tokens_per_s"] > 0
        # host syncs per step on the CUDA code path beside tokens/s
        assert r["syncs_backward"] == 0 and r["syncs_step"] == 1
        assert r["syncs_per_step"] == r["syncs_forward"] + 1
        assert r["syncs_forward"] == 0  # every router, ReLU included, on the padded device plan
    assert [s["router"] for s in mod["syncs"]] == [r["row"] for r in mod["throughput"]]
    relu_row = next(r for r in mod["throughput"] if r["row"] == "relu")
    assert relu_row["sparsity_mean"] > 0.5  # forced into the sparse stage
    assert mod["stages"]["steps_run"] >= 1 and len(mod["stages"]["steps"]) == mod["stages"]["steps_run"]
    assert {m["recompute_experts"] for m in mod["memory"]} == {False, True}
    assert res["elapsed_s"] > 0
    # a smoke run judges no target, names the preset it measured, and prints no profiler noise
    for t in res["layer"]["targets"] + mod["targets"]:
        assert t["met"] is None and t["judged"] is False and t["value"] is not None
    assert mod["preset"] == "micro"
    assert all("micro model" in t["target"] for t in mod["targets"][:2])
    out, err = capfd.readouterr()
    assert "wrote" in out and "smoke run" in out
    assert "MISSED" not in out and "[   met]" not in out and "tiny model" not in out
    assert "USDT" not in out + err and "profiler_start" not in out + err
    assert "settled at step None" not in out and " nan" not in out


def test_stages_line_without_settling():
    st = {"settled_at_step": None, "steps_run": 4, "relu_stage12_ms_per_step": 49.8,
          "relu_stage3_ms_per_step": float("nan")}
    line = cli._stages_line(st)
    assert "did not reach the target within the 4 steps" in line and "nan" not in line
    st.update(settled_at_step=3, relu_stage3_ms_per_step=40.0, stage12_extra_s=0.02)
    assert cli._stages_line(st).startswith("stages: settled at step 3 of 4")


def test_full_run_judges_targets():
    targets = [{"target": "a", "value": 1.2, "limit": "<= 1.15", "met": False}]
    assert cli._judge([dict(t) for t in targets], quick=False)[0]["met"] is False
    judged = cli._judge([dict(t) for t in targets], quick=True)[0]
    assert judged["met"] is None and judged["judged"] is False
