"""What a first-time user meets on the command line: a misplaced config path gets a
suggestion, and `remoe train > log 2>&1` logs data preparation and progress lines."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

from remoe.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_missing_config_suggests_the_one_that_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/dmoe.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("remoe train: error: config='configs/dmoe.yaml' does not exist "
                   "(did you mean configs/paper/dmoe.yaml?)")
    monkeypatch.chdir(tmp_path)  # elsewhere: the checkout's configs, as an absolute path
    assert main(["train", "dmoe.yaml"]) == 2
    assert f"(did you mean {REPO / 'configs' / 'paper' / 'dmoe.yaml'}?)" in capsys.readouterr().err
    assert main(["train", "nothing_like_it.yaml"]) == 2
    assert capsys.readouterr().err.strip().endswith("config='nothing_like_it.yaml' does not exist")


def _corpus(root: Path) -> list[str]:
    words = "alpha beta gamma delta river stone cloud paper light sound".split()
    sources = []
    for dom in ("one", "two"):
        d = root / dom
        d.mkdir(parents=True)
        for i in range(10):
            rng = random.Random(f"{dom}{i}")
            (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
        sources.append(f"{dom}={d}")
    return sources


def test_train_without_a_terminal_logs_progress(tmp_path):
    sources = _corpus(tmp_path / "corpus")
    sets = {"data.sources": "[" + ", ".join(sources) + "]", "data.cache_dir": tmp_path / "cache",
            "data.vocab_size": 300, "run.out_dir": tmp_path / "runs", "run.name": "p",
            "model.preset": "micro", "train.seq_len": 32, "train.micro_batch_size": 2,
            "train.max_steps": 25, "train.log_every": 10, "train.eval_every": 0,
            "train.save_every": 0, "train.eval_chunks_per_domain": 1,
            "analysis.record_masks_every": 0}
    argv = [sys.executable, "-m", "remoe.cli", "train", "--allocator", "default"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    log = tmp_path / "log"
    with log.open("w") as f:  # `remoe train > log 2>&1`
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    # data preparation reports its stages
    assert re.search(r"\[remoe\.data +[\d.]+s\] planning splits", text)
    assert re.search(r"\[remoe\.data +[\d.]+s\] data ready", text)
    # then progress lines: step of the total, tokens/s, ETA (steps 1, 10, 20 and the last)
    lines = re.findall(r"^step +(\d+)/25 \( *\d+%\) .* ([\d,]+) tok/s  ETA (\d+)m(\d\d)s$", text,
                       flags=re.M)
    steps = [int(s) for s, *_ in lines]
    assert {10, 20, 25} <= set(steps) and steps == sorted(steps)
    # the first step carries the warm-up: no ETA from it (it was ~8x too high)
    assert re.search(r"^step +1/25 \( *\d+%\) .* tok/s  ETA after warm-up$", text, flags=re.M)
    assert all(int(rate.replace(",", "")) > 0 for _, rate, _, _ in lines)
    last = lines[-1]
    assert (int(last[2]), int(last[3])) == (0, 0)  # nothing left at the last step
    assert "settled at step" in text  # the end-of-run summary follows, naming its numbers
    assert ("notes        validation = 1 sequences per domain (`remoe eval RUN`: the whole split)"
            "; lambda = after the last update (the next step's" in text)
