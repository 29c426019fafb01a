"""`remoe bench --quick` runs end to end and writes the expected JSON (no timing assertions)."""

from __future__ import annotations

import json
import math

from remoe.bench import cli


def test_quick_all_suites_write_expected_json(tmp_path, capsys):
    out = tmp_path / "quick.json"
    assert cli.main(["--suite", "all", "--quick", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "remoe-bench/1" and res["quick"] is True
    m = res["machine"]
    for key in ("cpu_model", "cores_logical", "torch", "threads", "transformers", "allocator"):
        assert key in m
    assert m["threads"] == 1
    assert res["machine_ceiling"]["matmul_fp32_gflops"] > 0

    rows = res["layer"]["rows"]
    names = {r["row"] for r in rows}
    assert names == {"dense", "relu", "topk", "relu_unfused", "hf_eager", "hf_grouped_mm"}
    for r in rows:
        for key in ("case", "E", "G", "k", "T", "wall_ms", "cpu_ms", "vs_dense", "gflops", "mfu",
                    "peak_mem_mb"):
            assert key in r, key
        assert r["wall_ms"] > 0 and r["peak_mem_mb"] > 0
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
    relu_row = next(r for r in mod["throughput"] if r["row"] == "relu")
    assert relu_row["sparsity_mean"] > 0.5  # forced into the sparse stage
    assert mod["stages"]["steps_run"] >= 1 and len(mod["stages"]["steps"]) == mod["stages"]["steps_run"]
    assert {m["recompute_experts"] for m in mod["memory"]} == {False, True}
    assert res["elapsed_s"] > 0
    assert "wrote" in capsys.readouterr().out
