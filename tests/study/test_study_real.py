"""One real ``remoe train`` child on a micro config, through the ``remoe study`` command."""

from __future__ import annotations

import csv
import json

import yaml

from remoe.cli import main


def test_real_micro_study_runs_tabulates_and_resumes(tmp_path):
    spec = {"budget": "one micro run of 3 steps, seconds",
            "base": {"model": {"preset": "micro", "router": "relu", "num_experts": 4},
                     "data": {"cache_dir": str(tmp_path / "data"), "max_bytes_per_domain": 20000,
                              "vocab_size": 300},
                     "train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 3,
                               "warmup_steps": 1, "eval_every": 0, "eval_chunks_per_domain": 1,
                               "save_every": 2, "log_every": 1},
                     "analysis": {"record_masks_every": 3, "calib_tokens": 32}},
            "groups": [{"name": "g", "runs": [{"label": "relu"}]}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["study", str(path), "--out", str(out), "--jobs", "2", "--no-report"]) == 0
    summary = json.loads((out / "runs/relu-s0/summary.json").read_text())
    assert summary["steps"] == 3 and summary["router"] == "relu"
    saved = yaml.safe_load((out / "runs/relu-s0/config.yaml").read_text())
    assert saved["train"]["num_threads"] >= 1 and saved["run"]["seed"] == 0
    with open(out / "results.csv") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["state"] == "done" and float(row["val_loss"]) == summary["val_loss"]
    assert row["inactive_source"] == "masks@3"
    assert "| `relu` | 1/1 |" in (out / "results.md").read_text()
    # --results-only rebuilds the tables from the run directories
    (out / "results.md").unlink()
    assert main(["study", str(path), "--out", str(out), "--results-only", "--no-report"]) == 0
    assert "| `relu` | 1/1 |" in (out / "results.md").read_text()
    # run again: nothing is trained again (the log gets no new attempt)
    log = (out / "logs/relu-s0.log").read_text()
    assert main(["study", str(path), "--out", str(out), "--no-report"]) == 0
    assert (out / "logs/relu-s0.log").read_text() == log


def test_results_only_needs_a_study_directory(tmp_path, capsys):
    spec = {"budget": "none", "base": {"model": {"preset": "micro"}},
            "groups": [{"name": "g", "runs": [{"label": "relu"}]}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["study", str(path), "--out", str(tmp_path / "nothing"), "--results-only"])
    err = capsys.readouterr().err
    assert code != 0 and "holds no study runs" in err and err.count("\n") == 1
    assert not (tmp_path / "nothing").exists()  # nothing written where no study is
