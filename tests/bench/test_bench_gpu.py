"""``remoe bench --suite gpu``: one line without CUDA; its CUDA-path logic on CPU."""

from __future__ import annotations

import pytest
import torch

from remoe.lab.bench import cli, gpu, gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_one_line_and_exit_0(capfd, tmp_path):
    assert cli.main(["--suite", "gpu", "--out", str(tmp_path / "gpu.json")]) == 0
    out, err = capfd.readouterr()
    assert out.count("\n") == 1 and out.startswith("gpu suite: no CUDA device here")
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA A10G", None),
    ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("Tesla T4", None)])
def test_data_sheet_peaks(name, peak):
    assert gpu.peak_bf16_tflops(name) == peak


def test_suite_logic_on_cpu():
    """The whole suite on CPU with a micro model: bf16 autocast puts the experts on grouped_mm
    in bf16, the on-device plan runs, and the syncs are those of the CUDA path."""
    lines = []
    res = gpu_check.run_suite(torch.device("cpu"), preset="micro", seq_len=32, micro_batch=2,
                              steps=1, warmup=1, vocab=384, matmul_n=128, log=lines.append)
    assert res["device"] == "cpu" and res["peak_bf16_tflops"] is None
    for r in res["loss_check"]:
        assert r["ok"], r
        assert r["expert_input_dtype_fp32"] == r["expert_input_dtype_bf16"] == (
            [] if r["router"] == "dense" else ["float32"])  # the residual stream stays fp32
    rows = {r["router"]: r for r in res["rows"]}
    assert set(rows) == {"dense", "topk", "relu"}
    for name, r in rows.items():
        assert r["backend"] == "grouped_mm" and r["precision"] == "bf16"
        assert r["tokens_per_s"] > 0 and r["train_tflops"] > 0 and r["mfu"] is None
        assert r["syncs_backward"] == 0 and r["syncs_step"] == 1, r["syncs_report"]
        moe = name != "dense"
        assert r["expert_input_dtype"] == (["bfloat16xbfloat16"] if moe else [])
        # the default exact plan: ReLU's nonzero once per MoE layer, fixed-k routers never
        assert r["syncs_forward"] == (r["moe_layers"] if name == "relu" else 0), r["syncs_report"]
        assert (r["sparsity"] is not None) == moe
    assert abs(rows["relu"]["sparsity"] - 0.875) < 0.03  # held at the sparse stage III
    text = gpu_check.table(res)
    assert text.splitlines()[0].startswith("| device | preset | row | mb x accum |")
    assert "| cpu | micro | relu | 2 x 1 |" in text and "not run (fewer than 2 GPUs)" in text
    assert rows["topk"]["pairs_per_token"] == 1.0
    assert abs(rows["relu"]["pairs_per_token"] - 1.0) < 0.02  # calibrated on the batches timed
    (ratio,) = gpu_check.relu_vs_topk(res["rows"])
    assert ratio["pair_ratio"] == pytest.approx(
        ratio["tokens_ratio"] * rows["relu"]["pairs_per_token"])
    assert "| ReLU row | vs TopK row |" in text
    assert any("bf16 vs fp32" in x for x in lines)


def test_kernel_categories_and_busy_time():
    cat = gpu.kernel_category
    assert cat("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>") == \
        "optimizer + clip"
    assert cat("cutlass3x_sm90_tensorop_gemm_grouped_bf16") == "grouped GEMM"
    assert cat("flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert cat("triton_red_fused__log_softmax_0") == "LM loss"
    assert cat("sm90_xmma_gemm_bf16bf16_bf16f32") == "dense GEMM"
    assert cat("aten::index_select") == "gather / scatter / index"
    assert cat("Memcpy DtoH (Device -> Pinned)") == "copy / memset"
    assert cat("triton_poi_fused_mul_silu_3") == "fused by inductor"
    # a fused RMSNorm with its cast is not a copy, a fused gather not an index kernel
    assert cat("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1") == "fused by inductor"
    assert cat("triton_poi_fused_index_select_2") == "fused by inductor"
    assert cat("void at::native::elementwise_kernel<direct_copy_kernel_cuda>") == "copy / memset"
    assert cat("aten::gelu") == "elementwise / other"
    assert gpu._busy_ms([(0, 1000), (500, 1500), (3000, 3500)]) == 2.0


def test_head_loss_whole_and_chunked_on_cpu():
    whole = gpu.head_loss(torch.device("cpu"), 16, 300, 64, reps=1, precision="fp32")
    chunked = gpu.head_loss(torch.device("cpu"), 16, 300, 64, chunk=16, reps=1, precision="fp32")
    compiled = gpu.head_loss(torch.device("cpu"), 16, 300, 64, reps=1, precision="fp32",
                             compiled=True)
    assert whole["ms"] > 0 and chunked["ms"] > 0 and chunked["chunk"] == 16
    assert compiled["ms"] > 0 and compiled["compiled"] and not whole["compiled"]
