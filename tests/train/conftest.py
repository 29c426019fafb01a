import pytest


@pytest.fixture(scope="session")
def tiny_data_cfg(micro_data_cfg):
    """The session's micro corpus (tests/conftest.py)."""
    return micro_data_cfg


@pytest.fixture
def make_overrides(tiny_data_cfg):
    return lambda out_dir, name, **extra: _overrides(tiny_data_cfg, out_dir, name, **extra)


def _overrides(data_cfg, out_dir, name, **extra):
    """--set overrides for a micro model on the session corpus."""
    base = {
        "run.out_dir": str(out_dir), "run.name": name, "model.preset": "micro",
        "data.cache_dir": data_cfg.cache_dir, "data.max_bytes_per_domain": data_cfg.max_bytes_per_domain,
        "data.vocab_size": data_cfg.vocab_size, "train.seq_len": 32, "train.micro_batch_size": 4,
        "train.max_steps": 6, "train.warmup_steps": 2, "train.eval_every": 3,
        "train.eval_chunks_per_domain": 2, "train.save_every": 3, "train.log_every": 0,
        "analysis.record_masks_every": 2, "analysis.calib_tokens": 64,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def train_then_crash():
    """``train_then_crash(cfg, steps)``: train ``steps`` steps (masks every 2), checkpoint, then
    drop the Trainer without finishing, as a crash would; resume with ``Trainer(cfg, resume=True)``."""

    def run(cfg, steps: int = 3) -> None:
        from remoe.train.trainer import Trainer

        t = Trainer(cfg, progress=False)
        for _ in range(steps):
            t._log(t.train_step(), None)
            if t.step % 2 == 0:
                t.record_masks()
        t.save()
        t.metrics.close()
        t.evals.close()

    return run


@pytest.fixture
def run_cmd():
    """``run_cmd(argv)``: run a command at one OpenMP thread; fail the test with its stderr."""
    import os
    import subprocess

    def run(cmd, env_extra=None):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    return run


@pytest.fixture
def one_vs_two_ranks(make_overrides, run_cmd, free_port, tmp_path):
    """``one_vs_two_ranks(common, one_extra)``: train the micro model once in one process with
    ``one_extra`` (e.g. two accumulated micro-batches) and once on two gloo ranks (torchrun),
    both with the ``common`` overrides; returns the two runs' metrics.jsonl records."""
    import json
    import sys

    def train(name, overrides, ranks):
        launch = [sys.executable, "-m", "remoe.cli"] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}", "-m", "remoe.cli"]
        run_cmd(launch + ["train", "--no-progress"] + [f"--set={o}" for o in overrides])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if x.strip()]

    def run(common, one_extra):
        one = train("one", make_overrides(tmp_path, "one", **common, **one_extra), 1)
        two = train("two", make_overrides(tmp_path, "two", **common), 2)
        return one, two

    return run
