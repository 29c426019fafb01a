"""``scripts/gpu_study.sh`` (remoe.lab.study.gpu_study) rehearsed on CPU.

The command's CPU path is the GPU path with a micro model: a tiny packed store (the built-in
corpus at 60 kB per domain, BPE 384) travels as the real one does; the script runs from a copy
of ``src/`` with ``zstandard`` and ``lm_eval`` unimportable (test_device_stack.py's
sitecustomize), sizes its steps from the measured throughput, trains the three runs, evaluates
them and writes its JSON files. In process: the JSON is on disk after every evaluation, a study
killed after its second evaluation keeps those, a run past the deadline is cut and the later
ones skipped, and the table and figure are rebuilt from the JSON files alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remoe.errors import ConfigError
from remoe.experiment import padded_vocab
from remoe.lab.study import gpu_report, gpu_runs, gpu_study
from remoe.train.optim import cosine_lr

ROOT = Path(__file__).resolve().parents[2]


def _device_stack():
    """test_device_stack.py's sitecustomize and blocked packages (one definition)."""
    spec = importlib.util.spec_from_file_location(
        "device_stack", Path(__file__).with_name("test_device_stack.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SITECUSTOMIZE, mod.BLOCKED


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """A tiny study store, built and packed as ``--build-data`` does the real one."""
    from remoe.data import DataConfig, prepare_data

    tmp = tmp_path_factory.mktemp("gpu-study-data")
    prepare_data(DataConfig(cache_dir=str(tmp / "cache"), max_bytes_per_domain=60_000,
                            vocab_size=384), progress=False)
    meta = gpu_study.pack_store(tmp / "cache", tmp / "pack")
    return tmp, meta


def test_pack_is_reproducible_and_checked(pack, tmp_path):
    tmp, meta = pack
    again = gpu_study.pack_store(tmp / "cache", tmp_path / "again")
    assert again["sha256"] == meta["sha256"] and meta["vocab_size"] == 384
    bundle = gpu_study.open_data(tmp / "pack", tmp_path / "scratch")
    assert bundle.vocab_size == 384 and bundle.split("train").num_tokens == meta["tokens"]["train"]
    bad = tmp_path / "bad"
    shutil.copytree(tmp / "pack", bad)
    with open(bad / gpu_study.ARCHIVE, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    with pytest.raises(ConfigError, match="does not match"):
        gpu_study.open_data(bad, tmp_path / "scratch2")
    with pytest.raises(ConfigError, match="no pack.json"):
        gpu_study.open_data(tmp_path, tmp_path / "scratch3")


def test_cpu_path_end_to_end_on_the_device_stack(pack, tmp_path):
    """The command as the device runs it, without zstandard / lm_eval, on CPU: exit 0, at
    most 8 files at most 2 folders down, every run the same steps, the schedule's horizon the
    sized one from the first step, the vocabulary the tokenizer's."""
    data, meta = pack
    sitecustomize, blocked = _device_stack()
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "src", repo / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (repo / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "gpu_study.sh", repo / "scripts")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        sitecustomize.format(blocked=blocked, copy=str(repo / "src")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "REMOE"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(repo / "src")]),
               OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHON=sys.executable,
               OUT=str(tmp_path / "out"), MPLBACKEND="Agg")
    proc = subprocess.run(["bash", str(repo / "scripts" / "gpu_study.sh"), "--data",
                           str(data / "pack"), "--budget-s", "15", "--max-steps", "5",
                           # the deadline far past the budget: a loaded machine (imports alone
                           # took 50 s at load 5 on 2 cores) must not cut the runs
                           "--deadline-s", "240"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.parts) <= 3 for p in files), files
    assert {str(p) for p in files} == {"gpu_study.json", "gpu_study.log", "gpu_study.md",
                                       "gpu_study.png", "runs/topk.json.gz",
                                       "runs/remoe_rec.json.gz", "runs/remoe_paper.json.gz"}
    summary = gpu_report.read_summary(out)
    plan = summary["plan"]
    assert summary["state"] == "done" and plan["sized"] and 3 <= plan["steps"] <= 5, plan
    assert summary["data"]["model_vocab"] == padded_vocab(384)
    runs = gpu_report.read_runs(out)
    assert list(runs) == ["topk", "remoe_rec", "remoe_paper"]
    st = summary["settings"]
    for name, rec in runs.items():
        assert rec["state"] == "done", (name, rec.get("error"))
        assert rec["steps"] == plan["steps"] and rec["tokens"] == plan["tokens_per_run"]
        assert rec["model"]["vocab_size"] == padded_vocab(384) == rec["model"]["tokenizer_vocab"]
        lines = rec["files"]["metrics.jsonl"]
        assert [r["step"] for r in lines] == list(range(1, plan["steps"] + 1))
        # the horizon was set inside the warm-up: every lr is that of a run configured with it
        for r in lines:
            want = cosine_lr(r["step"] - 1, st["lr"], st["min_lr"], st["warmup_steps"],
                             plan["steps"])
            assert math.isclose(r["lr"], want, rel_tol=1e-9), (name, r["step"])
        assert [e["step"] for e in rec["curve"]] == plan["eval_steps"]
        assert [e["step"] for e in rec["files"]["eval.jsonl"]] == plan["eval_steps"]
        assert all(e["flops"] > 0 for e in rec["curve"])
        assert math.isfinite(rec["whole_validation"]["loss"])
        eff = rec["layers_end"]["effective_experts"]
        assert len(eff) == 2 and all(1.0 <= e <= 8.0 + 1e-9 for e in eff)
        assert rec["files"]["summary.json"]["final_dir"] is None
    md = (out / "gpu_study.md").read_text()
    assert "vocabulary 384" in md and "1.936" in md and "one seed is one seed" in md


def _settings(extra: list[str]) -> gpu_runs.Settings:
    return gpu_runs.resolve(gpu_study.parser().parse_args(extra), cuda=False)


class _Killed(BaseException):
    """Stands for the device's kill at its time limit."""


def _study(pack, tmp_path, s, out):
    from remoe.data import load_prepared

    bundle = load_prepared(pack[0] / "cache")
    info = {"store": bundle.manifest["dir"], "tokenizer_vocab": bundle.vocab_size,
            "model_vocab": padded_vocab(bundle.vocab_size), "tokens": {"train": 1}}
    return gpu_runs.Study(s, bundle, out, tmp_path / "work", info, {"device": {"name": "cpu"}},
                           t0=time.perf_counter())


def test_json_on_disk_after_every_evaluation_and_a_killed_study_keeps_it(pack, tmp_path):
    seen = []

    class Output(gpu_report.Output):
        def write_run(self, name, record):
            path = super().write_run(name, record)
            on_disk = gpu_report.read_runs(self.dir)[name]
            seen.append((len(on_disk["curve"]), len(on_disk["files"]["metrics.jsonl"])))
            if len(seen) == 2:
                raise _Killed
            return path

    out = Output(tmp_path / "out", echo=lambda line: None)
    s = _settings(["--steps", "6", "--evals", "3", "--runs", "topk"])
    study = _study(pack, tmp_path, s, out)
    study.now = lambda: 0.0
    with pytest.raises(_Killed):
        study.run_all()
    assert seen == [(1, 2), (2, 4)]  # evaluations at steps 2 (probe) and 4
    rec = gpu_report.read_runs(out.dir)["topk"]
    assert rec["state"] == "running" and rec["steps"] == 4
    assert [e["step"] for e in rec["curve"]] == [2, 4]
    summary = gpu_report.read_summary(out.dir)  # written after the run's file: one behind
    assert summary["state"] == "running" and summary["runs"]["topk"]["val_loss"] == \
        rec["curve"][0]["val_loss"]


def test_a_run_past_the_deadline_is_cut_and_later_runs_are_skipped(pack, tmp_path):
    out = gpu_report.Output(tmp_path / "out", echo=lambda line: None)
    s = _settings(["--steps", "6", "--evals", "3", "--runs", "topk,remoe_rec",
                   "--deadline-s", "100"])
    study = _study(pack, tmp_path, s, out)
    clock = {"t": 0.0}
    study.now = lambda: clock["t"]
    orig = out.write_run

    def write_run(name, record):  # the clock passes the deadline at the first evaluation
        clock["t"] = 1000.0
        return orig(name, record)

    out.write_run = write_run
    study.run_all()
    runs = gpu_report.read_runs(out.dir)
    assert runs["topk"]["state"] == "cut" and runs["topk"]["steps"] == 2
    assert runs["topk"]["whole_validation"] is None
    assert len(runs["topk"]["files"]["metrics.jsonl"]) == 2
    summary = gpu_report.read_summary(out.dir)
    assert summary["runs"]["remoe_rec"]["state"] == "skipped"
    assert "deadline" in summary["runs"]["remoe_rec"]["reason"]
    md = (out.dir / "gpu_study.md").read_text()
    assert "cut (at step 2" in md and "skipped: past the" in md


def test_results_only_rebuilds_table_and_figure_from_the_json(pack, tmp_path):
    out = gpu_report.Output(tmp_path / "out", echo=lambda line: None)
    s = _settings(["--steps", "4", "--evals", "2", "--runs", "topk,remoe_rec"])
    study = _study(pack, tmp_path, s, out)
    study.run_all()
    first = (out.dir / "gpu_study.md").read_text()
    copy = tmp_path / "committed"
    shutil.copytree(out.dir, copy, ignore=shutil.ignore_patterns("*.md", "*.png", "*.log"))
    assert gpu_study.main(["--results-only", str(copy)]) == 0
    assert (copy / "gpu_study.md").read_text() == first
    assert (copy / "gpu_study.png").stat().st_size > 1000
    runs = gpu_report.read_runs(copy)
    whole = runs["remoe_rec"]["whole_validation"]["loss"]
    assert f"{whole:.4f}" in first
    for value in ("1.936", "1.921", "39.67", "40.03", "2.032", "30B"):
        assert value in first
    row = json.loads((copy / "gpu_study.json").read_text())["runs"]["topk"]
    assert row["effective_experts_mean"] == pytest.approx(
        sum(runs["topk"]["layers_end"]["effective_experts"]) / 2)


def test_plan_steps_fills_the_budget():
    kw = dict(step_s=0.1, speeds=[1.0, 0.8, 0.8], done=24, per_run_s=20.0, setup_s=30.0,
              min_steps=25, margin=0.05)

    def cost(n):  # the first run's remaining steps, then the others with their set-up
        return ((n - 24) * 0.1 + sum(n * 0.1 / sp for sp in kw["speeds"][1:]) + 3 * 20.0
                + 2 * 30.0)

    n = gpu_runs.plan_steps(500.0, **kw)
    assert cost(n) <= 500.0 * 0.95 < cost(n + 1)
    assert gpu_runs.plan_steps(10.0, **kw) == 25  # no time: the least
    assert gpu_runs.eval_steps(100, 24, 4) == [24, 25, 50, 75, 100]
    assert gpu_runs.eval_steps(5, 2, 2) == [2, 4, 5]


def test_effective_experts():
    assert gpu_report.effective_experts([[5, 5, 5, 5]]) == [pytest.approx(4.0)]
    assert gpu_report.effective_experts([[9, 0, 0], [0, 0, 0]]) == [pytest.approx(1.0), None]


def test_cuda_runs_use_the_capacity_plan_and_cpu_runs_the_default(tmp_path):
    args = gpu_study.parser().parse_args([])
    cuda = gpu_runs.base_sets(gpu_runs.resolve(args, cuda=True), "d", 8192, tmp_path)
    cpu = gpu_runs.base_sets(gpu_runs.resolve(args, cuda=False), "d", 8192, tmp_path)
    assert "train.dispatch_plan=capacity" in cuda  # ReLU exact, without a wait per layer
    assert not any(s.startswith("train.dispatch_plan") for s in cpu)
