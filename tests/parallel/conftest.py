"""Fixtures of the multi-process tests: a micro model on the session corpus, and commands run
with a deadline (a hang fails the test instead of stalling the suite)."""

import os
import signal
import subprocess

import pytest

DEADLINE_S = 600


@pytest.fixture
def make_overrides(micro_data_cfg):
    """``make_overrides(out_dir, name, **extra)``: --set overrides for a micro model."""

    def overrides(out_dir, name, **extra):
        base = {"run.out_dir": str(out_dir), "run.name": name, "model.preset": "micro",
                "data.cache_dir": micro_data_cfg.cache_dir,
                "data.max_bytes_per_domain": micro_data_cfg.max_bytes_per_domain,
                "data.vocab_size": micro_data_cfg.vocab_size, "train.seq_len": 32,
                "train.warmup_steps": 2, "train.eval_chunks_per_domain": 2,
                "train.log_every": 0, "analysis.calib_tokens": 64, **extra}
        return [f"{k}={v}" for k, v in base.items()]

    return overrides


@pytest.fixture
def run_cmd():
    """``run_cmd(argv)``: run at one OpenMP thread with a deadline; fail with its stderr."""

    def run(cmd):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # a session of its own: on a hang the launcher and all its ranks are killed together
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"{' '.join(cmd[:8])} ... did not finish in {DEADLINE_S} s (hang)")
        assert proc.returncode == 0, err[-3000:]
        return out

    return run
