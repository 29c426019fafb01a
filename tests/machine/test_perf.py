"""remoe.machine.perf: the measured matmul ceiling and MFU; the run summary reports MFU."""

import torch

from remoe.machine import perf


def test_ceiling_is_measured_without_touching_the_global_rng():
    state = torch.random.get_rng_state()
    wall, cpu = perf.matmul_gflops(128, 128, 128, reps=2)
    assert wall > 0 and cpu > 0
    assert torch.equal(state, torch.random.get_rng_state())


def test_mfu_arithmetic():
    assert perf.mfu(100e9, 2.0, 100.0) == 0.5
    assert perf.mfu(100e9, 2.0, 100.0, processes=2) == 0.25
    assert perf.mfu(1e9, 0.0, 100.0) is None and perf.mfu(1e9, 1.0, 0.0) is None


def test_summary_text_reports_mfu():
    from remoe.train.metrics import format_summary

    s = {"run_dir": "r", "stop_reason": "max_steps", "router": "relu", "params_total": 1e6,
         "params_active": 5e5, "steps": 3, "tokens": 100, "flops": 1e9, "elapsed_s": 2.0,
         "tokens_per_s": 50.0, "final_lm_loss": 1.0, "val_loss": None, "target_sparsity": None,
         "final_dir": "f", "mfu": 0.1234, "matmul_ceiling_gflops": 70.0}
    text = format_summary(s)
    assert "MFU          0.123 of the measured fp32 matmul ceiling (70.0 GFLOP/s" in text
