"""``remoe eval`` on a tiny saved run: loss per domain, built-in tasks, JSON + CSV."""

from __future__ import annotations

import csv
import json
import math

from remoe.cli import main


def test_remoe_eval_cli_on_a_tiny_run(tmp_path, tiny_run, held_out_docs, capsys, no_network):
    run = tiny_run
    out = tmp_path / "res" / "results.json"
    rc = main(["eval", str(run), "--tasks", "builtin,arc_easy", "--limit", "4",
               "--num-examples", "6", "--out", str(out), "--batch-size", "4",
               "--loss-chunks", "2", "--names", "Tiny"])
    assert rc == 0
    printed = capsys.readouterr()
    assert "| Model | validation loss |" in printed.out
    assert "| Tiny |" in printed.out and "HellaSwag*" in printed.out
    assert "task arc_easy" in printed.err and "--task-data-dir" in printed.err

    doc = json.loads(out.read_text())
    (m,) = doc["models"]
    assert m["name"] == "Tiny" and m["loss_skipped"] is None
    loss = m["loss"]
    assert set(loss["domains"]) == set(held_out_docs)
    assert loss["seq_len"] == 32 and loss["tokens"] == 32 * 2 * len(held_out_docs)
    assert math.isfinite(loss["loss"]) and 0 < loss["loss"] < 2 * math.log(320)
    for task in ("remoe_lambada", "remoe_hellaswag", "remoe_domain"):
        assert 0.0 <= m["zero_shot"][task]["acc"] <= 1.0
        if task != "remoe_lambada":
            assert 0.0 <= m["zero_shot"][task]["acc_mutual_info"] <= 1.0
        assert m["n_samples"][task] == 4
    assert "arc_easy" in doc["tasks"]["skipped"]
    assert doc["tasks"]["builtin_manifest"]["tasks"]["remoe_hellaswag"]["examples"] == 6
    assert m["averages"]["builtin"] is not None and m["averages"]["standard"] is None

    rows = list(csv.reader(open(out.with_suffix(".csv"))))
    assert len(rows) == 2 and rows[1][0] == "Tiny"
    assert float(rows[1][rows[0].index("loss")]) == loss["loss"]
    assert not (run / "eval_results.json").exists()  # --out given: written there only

    # without --out the run keeps its own results, where `remoe report RUN` finds them
    assert main(["eval", str(run), "--tasks", "remoe_lambada", "--limit", "4",
                 "--num-examples", "6", "--batch-size", "4", "--loss-chunks", "2"]) == 0
    printed = capsys.readouterr()
    assert "## Held-out loss (validation, at most 2 sequences per domain)" in printed.out
    mine = json.loads((run / "eval_results.json").read_text())
    assert [x["name"] for x in mine["models"]] == ["tiny"]
    assert mine["loss_chunks_per_domain"] == 2
    assert mine["models"][0]["loss"]["loss"] == loss["loss"]  # same model, same data
    report = tmp_path / "report.html"
    assert main(["report", str(run), "--out", str(report), "--no-model"]) == 0
    html = report.read_text()
    acc = 100 * mine["models"][0]["zero_shot"]["remoe_lambada"]["acc"]
    assert "LAMBADA* (acc)" in html and f"{acc:.2f}" in html
    assert "held-out loss: validation (at most 2 sequences per domain, remoe eval)" in html
    assert no_network == []


def test_unknown_task_stops_before_any_work(tmp_path, capsys):
    # the checkpoint does not even exist: the task names are checked first
    rc = main(["eval", str(tmp_path / "nowhere"), "--tasks", "builtin,hellaswg"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown task 'hellaswg' (did you mean hellaswag" in err
    assert main(["eval", str(tmp_path / "nowhere"), "--tasks", "bogus"]) == 2
    assert "unknown task 'bogus'" in capsys.readouterr().err
