"""``remoe analyze`` updates ``analysis.json``: a later, narrower or failing analysis never
erases the numbers of an earlier one."""

from __future__ import annotations

import json

from remoe.cli import main


def test_a_later_analysis_keeps_the_earlier_numbers(topk_run, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["analyze", "stages", str(topk_run), "--out", str(out), "--smooth", "1"]) == 0
    first = json.loads((out / "analysis.json").read_text())
    assert isinstance(first["stages"], dict)

    # another analysis: stages stay
    assert main(["analyze", "sparsity", str(topk_run), "--out", str(out)]) == 0
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["stages"] == first["stages"] and isinstance(doc["sparsity"], dict)

    # an analysis that is skipped now (this run has no model) fails the command; a skip
    # never replaces numbers, and what has no numbers is listed as skipped
    capsys.readouterr()
    assert main(["analyze", "heatmap", str(topk_run), "--out", str(out)]) == 1
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["stages"] == first["stages"] and isinstance(doc["sparsity"], dict)
    assert "heatmap" in doc["skipped"] and "stages" not in doc["skipped"]


def test_a_skip_never_replaces_a_result():
    from remoe.lab.analysis.analyze import merge_previous

    prev = {"run": "r", "stages": {"files": ["stages.json"], "settle_step": 61}, "skipped": {}}
    now = {"run": "r", "skipped": {"stages": "no metrics"}, "fingerprint": "x"}
    merged = merge_previous(prev, now)
    assert merged["stages"]["settle_step"] == 61 and merged["skipped"] == {}
    assert merged["kept"] == ["stages"]
    other = {"run": "elsewhere", "skipped": {}}
    assert merge_previous(prev, dict(other)) == other  # another run's file is not merged
