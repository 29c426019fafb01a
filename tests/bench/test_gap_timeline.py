"""scripts/gap_timeline.py: a run's loss gap to a reference over windows, and its phases."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gap_timeline.py"


def _run(root: Path, name: str, lm, penalty, lam, evals=()):
    d = root / "runs" / name
    d.mkdir(parents=True)
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
        for i, (x, p, l) in enumerate(zip(lm, penalty, lam), start=1):
            f.write(json.dumps({"step": i, "loss": x + p, "lm_loss": x, "lambda": l,
                                "sparsity": 0.875, "lr": 1e-3}) + "\n")
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "val_loss": v}) + "\n"
                                          for s, v in evals))


def test_windows_and_phases_measure_the_gap_and_the_penalty(tmp_path, load_script):
    # 8 steps, windows of 2: the run trails by 0.1 in steps 3-4, by 0.3 in steps 7-8
    ref = [5.0] * 8
    run = [5.0, 5.0, 5.1, 5.1, 5.2, 5.2, 5.3, 5.3]
    pen = [0.0, 0.0, 0.1, 0.1, 0.0, 0.0, 0.7, 0.7]
    _run(tmp_path, "a-s0", run, pen, [1, 1, 2, 2, 3, 3, 8, 8], evals=[(4, 4.5), (8, 4.0)])
    _run(tmp_path, "b-s0", ref, [0.0] * 8, [0] * 8, evals=[(4, 4.4), (8, 3.5)])
    mod = load_script("gap_timeline")
    r = mod.timeline(tmp_path / "runs", "a-s0", "b-s0", 2)
    assert [w["steps"] for w in r["windows"]] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert [round(w["train_lm_gap"], 6) for w in r["windows"]] == [0.0, 0.1, 0.2, 0.3]
    assert r["windows"][0]["val_gap"] is None  # no evaluation at step 2
    assert r["windows"][1]["val_gap"] == pytest.approx(0.1)
    assert r["windows"][3]["val_gap"] == pytest.approx(0.5)
    assert r["windows"][3]["penalty_share"] == pytest.approx(0.7 / 6.0)
    ph = mod.phases(r, (3, 4), (7, 8))
    assert ph["gap_change"] == pytest.approx(0.2)
    assert ph["penalty_share_change"] == pytest.approx(0.7 / 6.0 - 0.1 / 5.2)
    assert ph["lambda_ratio"] == pytest.approx(4.0)


def test_cli_writes_json_and_markdown_and_refuses_a_missing_run(tmp_path):
    _run(tmp_path, "a-s0", [5.1] * 4, [0.0] * 4, [1] * 4)
    _run(tmp_path, "b-s0", [5.0] * 4, [0.0] * 4, [0] * 4)
    out = tmp_path / "out" / "gap.json"
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--pairs", "a:b", "--seeds", "0",
           "--window", "2", "--early", "1", "2", "--late", "3", "4", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    res = json.loads(out.read_text())["results"][0]
    assert res["phases"]["gap_change"] == pytest.approx(0.0)
    assert "| 1-2 | +0.100 |" in out.with_suffix(".md").read_text()
    bad = subprocess.run(cmd[:-2] + ["--seeds", "1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "a-s1" in bad.stderr
