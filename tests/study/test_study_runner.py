"""The runner with a stub trainer: jobs and threads, no rerun of finished runs, resume after
kill -9, failures, match_flops_of, changed configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remoe.errors import ConfigError
from remoe.lab.study.runner import Study, cores
from remoe.lab.study.spec import load_spec


STUB = Path(__file__).with_name("stub_train.py")


def stub_command(config_path, flags):
    """The study's child command, with the stub in place of ``remoe train``."""
    return [sys.executable, str(STUB), str(config_path), *flags]


def _calls(out: Path) -> list[str]:
    p = out / "stub_calls.log"
    return p.read_text().splitlines() if p.exists() else []


def _study(spec_path, out, **kw):
    return Study(load_spec(spec_path), out, command=stub_command, log=lambda m: None, **kw)


def test_runs_jobs_threads_and_never_redoes_finished_runs(write_spec, tmp_path):
    spec = write_spec({"seeds": [0, 1], "groups": [
        {"name": "g", "grid": {"model.router": ["topk", "relu"]}},
        {"name": "m", "label": "flops-{label}", "runs": [{"label": "dense",
                                                          "set": {"model.router": "dense"}}],
         "match_flops_of": "relu", "seeds": [1]}]})
    out = tmp_path / "out"
    assert _study(spec, out, jobs=2).run(poll_s=0.02) == 0
    calls = _calls(out)
    assert len(calls) == 5
    threads = max(1, cores() // 2)
    assert all(f"threads={threads} omp={threads}" in c for c in calls)
    state = json.loads((out / "study.json").read_text())
    assert {n: r["state"] for n, r in state["runs"].items()} == dict.fromkeys(
        ["topk-s0", "topk-s1", "relu-s0", "relu-s1", "flops-dense-s1"], "done")
    # the matched run stopped at the FLOPs its reference spent (stub: 1000 * E per step)
    ref = json.loads((out / "runs/relu-s1/summary.json").read_text())["flops"]
    cfg = (out / "configs/flops-dense-s1.yaml").read_text()
    assert f"max_flops: {ref}" in cfg
    # a second study on the same directory does nothing
    assert _study(spec, out, jobs=1).run(poll_s=0.02) == 0
    assert len(_calls(out)) == 5


# a base with no shape fields: a run started from another's weights takes its shape from them
BASE_NO_SHAPE = {"train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 3}}


def test_init_from_run_waits_for_its_source_and_skips_if_it_failed(write_spec, tmp_path,
                                                                 monkeypatch):
    spec = write_spec({"base": BASE_NO_SHAPE, "groups": [
        {"name": "pre", "set": {"model.preset": "micro", "model.num_experts": 4},
         "runs": [{"label": "dense", "set": {"model.router": "dense"}},
                                 {"label": "topk", "set": {"model.router": "topk"}}]},
        {"name": "cont", "runs": [{"label": "up", "init_from_run": "dense"},
                                  {"label": "swap", "init_from_run": "topk"}],
         "set": {"model.router": "relu"}},
        {"name": "scratch", "set": {"model.preset": "micro", "model.num_experts": 4},
         "runs": [{"label": "relu", "set": {"model.router": "relu"}}],
         "match_flops_of": ["dense", "up"]}]})
    out = tmp_path / "out"
    monkeypatch.setenv("STUB_FAIL", "topk-s0")
    assert _study(spec, out, jobs=2).run(poll_s=0.02) == 1  # the stub exits 4 if started early
    state = json.loads((out / "study.json").read_text())["runs"]
    assert {n: r["state"] for n, r in state.items()} == {
        "dense-s0": "done", "topk-s0": "failed", "up-s0": "done", "swap-s0": "skipped",
        "relu-s0": "done"}
    assert "up-s0  threads=1 omp=1 init=dense-s0" in _calls(out)
    # the scratch run stopped at the FLOPs of dense + upcycled together
    flops = [json.loads((out / f"runs/{n}/summary.json").read_text())["flops"]
             for n in ("dense-s0", "up-s0")]
    assert f"max_flops: {sum(flops)}" in (out / "configs/relu-s0.yaml").read_text()
    monkeypatch.delenv("STUB_FAIL")
    assert _study(spec, out, jobs=2).run(poll_s=0.02) == 0
    assert [c.split()[0] for c in _calls(out)][-2:] == ["topk-s0", "swap-s0"]


def test_failed_run_is_reported_and_does_not_stop_the_others(write_spec, tmp_path, monkeypatch):
    spec = write_spec({"groups": [{"name": "g", "grid": {"model.router": ["topk", "relu"]}},
                                  {"name": "m", "label": "m-{label}", "runs": [{"label": "d"}],
                                   "match_flops_of": "relu"}]})
    out = tmp_path / "out"
    monkeypatch.setenv("STUB_FAIL", "relu-s0")
    logs = []
    st = Study(load_spec(spec), out, command=stub_command, log=logs.append)
    assert st.run(poll_s=0.02) == 1
    state = json.loads((out / "study.json").read_text())["runs"]
    assert state["topk-s0"]["state"] == "done"
    assert state["relu-s0"]["state"] == "failed" and state["relu-s0"]["exit_status"] == 3
    assert state["m-d-s0"]["state"] == "skipped"
    text = "\n".join(logs)
    assert "FAILED relu-s0: exit status 3" in text and "stub: simulated failure" in text
    monkeypatch.delenv("STUB_FAIL")
    assert _study(spec, out).run(poll_s=0.02) == 0  # retried; topk not redone
    assert [c.split()[0] for c in _calls(out)] == ["topk-s0", "relu-s0", "relu-s0", "m-d-s0"]


def test_changed_config_of_a_finished_run_is_refused(write_spec, tmp_path):
    spec = write_spec({"groups": [{"name": "g", "set": {"model.router": "topk"}}]})
    out = tmp_path / "out"
    assert _study(spec, out).run(poll_s=0.02) == 0
    spec = write_spec({"groups": [{"name": "g", "set": {"model.router": "relu"}}]})
    with pytest.raises(ConfigError, match=r"g-s0 \(model.router: 'topk' -> 'relu'\)"):
        _study(spec, out).run(poll_s=0.02)


DRIVER = """
import sys
from remoe.lab.study.runner import Study
from remoe.lab.study.spec import load_spec
def stub_command(config_path, flags):
    return [sys.executable, {stub!r}, str(config_path), *flags]
Study(load_spec({spec!r}), {out!r}, jobs=2, command=stub_command).run(poll_s=0.02)
"""


def test_kill_9_mid_study_then_rerun_resumes(write_spec, tmp_path):
    spec = write_spec({"groups": [{"name": "g", "grid": {"model.num_experts": [2, 4, 8]},
                                   "stop": {"steps": 6}}]})
    out = tmp_path / "out"
    env = {**os.environ, "STUB_STEP_S": "0.4"}
    code = DRIVER.format(stub=str(STUB), spec=str(spec), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.time() + 120
    # kill once the first two runs are mid-way (a checkpoint, no summary)
    while time.time() < deadline:
        ck = [out / "runs" / n / "checkpoints" / "LATEST" for n in ("E2-s0", "E4-s0")]
        if all(p.exists() for p in ck) and int(ck[0].read_text()[5:]) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)  # children got SIGTERM from the kernel (PR_SET_PDEATHSIG)
    assert not (out / "runs/E2-s0/summary.json").exists()
    steps_before = len((out / "runs/E2-s0/metrics.jsonl").read_text().splitlines())
    time.sleep(0.8)  # nobody keeps writing: the children are gone
    assert len((out / "runs/E2-s0/metrics.jsonl").read_text().splitlines()) == steps_before
    before = json.loads((out / "study.json").read_text())["runs"]["E2-s0"]
    assert before["state"] == "running" and before["total_wall_s"] == 0.0
    lost = (out / "runs/E2-s0/metrics.jsonl").stat().st_mtime - before["started"]
    assert lost >= 0.8  # two steps of 0.4 s at least

    assert _study(spec, out, jobs=2).run(poll_s=0.02) == 0
    calls = _calls(out)
    assert [c for c in calls if c.startswith("E2-s0")][-1].startswith("E2-s0 --resume")
    assert [c for c in calls if c.startswith("E8-s0")] == [calls[-1]]
    assert all(c.split()[1] != "--resume" for c in calls if c.startswith("E8-s0"))
    metrics = (out / "runs/E2-s0/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics][-1] == 6
    # the killed attempt's time counts (until its last write), beside the resumed one
    after = json.loads((out / "study.json").read_text())["runs"]["E2-s0"]
    assert after["attempts"] == 2
    assert after["total_wall_s"] == pytest.approx(after["wall_s"] + lost, abs=0.2)  # + LATEST
    n_calls = len(calls)
    assert _study(spec, out, jobs=2).run(poll_s=0.02) == 0  # all done: nothing runs
    assert len(_calls(out)) == n_calls


def test_only_selects_runs_and_their_flops_reference(write_spec, tmp_path):
    from remoe.lab.study.cli import _select

    spec = load_spec(write_spec({"groups": [
        {"name": "g", "grid": {"model.router": ["topk", "relu"]}},
        {"name": "m", "label": "m-{label}", "runs": [{"label": "d"}], "match_flops_of": "relu"}]}))
    st = Study(spec, tmp_path / "out", command=stub_command, only=_select(spec, ["m"]))
    assert [r.name for r in st.selected()] == ["relu-s0", "m-d-s0"]
    with pytest.raises(ConfigError, match="matches no run"):
        _select(spec, ["zzz*"])


STUB_EVAL = Path(__file__).with_name("stub_eval.py")


def stub_eval_command(run_dir, tasks, limit, loss=False):
    return [sys.executable, str(STUB_EVAL), str(run_dir), "--tasks", tasks, "--no-loss",
            *(["--limit", str(limit)] if limit else [])]


def test_eval_section_evaluates_each_trained_run_once(write_spec, tmp_path, monkeypatch):
    from remoe.lab.study.results import write_results

    groups = [{"name": "g", "grid": {"model.router": ["topk", "relu"]}}]
    plain = write_spec({"seeds": [0, 1], "groups": groups}, name="plain.yaml")
    out = tmp_path / "out"
    assert _study(plain, out, jobs=2, evaluate=stub_eval_command).run(poll_s=0.02) == 0
    assert not [c for c in _calls(out) if c.startswith("eval ")]
    # the same grid with zero-shot tasks: the four trained runs are evaluated, not retrained
    spec = write_spec({"seeds": [0, 1], "groups": groups,
                       "eval": {"tasks": "builtin", "limit": 7}})
    monkeypatch.setenv("STUB_EVAL_FAIL", "relu-s1")
    assert _study(spec, out, jobs=2, evaluate=stub_eval_command).run(poll_s=0.02) == 1
    evals = [c for c in _calls(out) if c.startswith("eval ")]
    assert sorted(c.split()[1] for c in evals) == ["relu-s0", "relu-s1", "topk-s0", "topk-s1"]
    assert all("--tasks builtin --no-loss --limit 7" in c for c in evals)
    assert len(_calls(out)) == 4 + 4  # no training child was started again
    state = json.loads((out / "study.json").read_text())["runs"]
    assert state["relu-s1"]["state"] == "failed" and state["relu-s0"]["state"] == "done"
    assert state["relu-s0"]["eval_wall_s"] > 0
    # a rerun evaluates only the run whose evaluation failed
    monkeypatch.delenv("STUB_EVAL_FAIL")
    assert _study(spec, out, jobs=2, evaluate=stub_eval_command).run(poll_s=0.02) == 0
    assert [c.split()[1] for c in _calls(out)[8:]] == ["relu-s1"]
    # another limit is another evaluation
    spec2 = write_spec({"seeds": [0, 1], "groups": groups, "eval": {"tasks": "builtin"}},
                       name="spec2.yaml")
    assert _study(spec2, out, jobs=1, evaluate=stub_eval_command).run(poll_s=0.02) == 0
    assert len(_calls(out)) == 9 + 4
    # the table: accuracy in %, mean ± std over the seeds (Task A: 25 and 35)
    _, md_path, _ = write_results(load_spec(spec2), out, json.loads(
        (out / "study.json").read_text()))
    md = md_path.read_text()
    assert "| run | n | Task A* (acc) | Task B* (MI) | avg |" in md
    assert "| `topk` | 2/2 | 30.0 ± 7.1 | 50.0 ± 0.0 | 40.0 ± 3.5 |" in md


def test_reuse_takes_identical_finished_runs_from_another_study(write_spec, tmp_path):
    a_spec = write_spec({"seeds": [0, 1], "groups": [{"name": "g", "grid": {
        "model.router": ["topk", "relu"]}}]}, name="a.yaml")
    a_out = tmp_path / "a"
    assert _study(a_spec, a_out).run(poll_s=0.02) == 0
    # another study: other names for two of a's experiments, one new run, one matched to an
    # adopted reference, and seed 2 (never trained in a)
    b_spec = write_spec({"seeds": [0, 2], "groups": [
        {"name": "scale", "label": "{label}-E4", "grid": {"model.router": ["topk", "relu"]},
         "set": {"model.granularity": 1}},  # the default written out: the same model
        {"name": "new", "runs": [{"label": "relu-E8", "set": {"model.router": "relu",
                                                              "model.num_experts": 8}}],
         "seeds": [0]},
        {"name": "m", "label": "flops-{label}", "runs": [{"label": "dense", "set": {
            "model.router": "dense"}}], "match_flops_of": "relu-E4", "seeds": [0]}]},
        name="b.yaml")
    b_out = tmp_path / "b"
    from remoe.lab.study.cli import dry_run

    lines = []
    dry_run(_study(b_spec, b_out, reuse=(a_out,)), log=lines.append, gflops=50.0)
    state = {x.split()[0]: x.split()[1] for x in lines if x.split() and x.split()[0].endswith(
        ("-s0", "-s2"))}
    assert state == {"topk-E4-s0": "reuse", "relu-E4-s0": "reuse", "topk-E4-s2": "to",
                     "relu-E4-s2": "to", "relu-E8-s0": "to", "flops-dense-s0": "to"}
    logs = []
    st = Study(load_spec(b_spec), b_out, command=stub_command, log=logs.append, reuse=(a_out,))
    assert st.run(poll_s=0.02) == 0
    b_calls = [c.split()[0] for c in _calls(b_out)]
    assert sorted(b_calls) == ["flops-dense-s0", "relu-E4-s2", "relu-E8-s0", "topk-E4-s2"]
    assert "  reuse relu-E4-s0  <- " + str((a_out / "runs/relu-s0").resolve()) in "\n".join(logs)
    src, dst = a_out / "runs/relu-s0/summary.json", b_out / "runs/relu-E4-s0/summary.json"
    assert os.stat(src).st_ino == os.stat(dst).st_ino  # hard-linked, not copied
    runs = json.loads((b_out / "study.json").read_text())["runs"]
    assert runs["relu-E4-s0"]["state"] == "done" and "reused from" in runs["relu-E4-s0"]["message"]
    # the matched run stopped at the adopted reference's FLOPs
    ref = json.loads(src.read_text())["flops"]
    assert f"max_flops: {ref}" in (b_out / "configs/flops-dense-s0.yaml").read_text()
    # the study resumed (with or without --reuse): the adopted runs, whose saved configs carry
    # their old names and directories, are the same experiments and are kept, not refused
    n_calls = len(_calls(b_out))
    for reuse in ((a_out,), ()):
        assert Study(load_spec(b_spec), b_out, command=stub_command, reuse=reuse).run(
            poll_s=0.02) == 0
    assert len(_calls(b_out)) == n_calls
