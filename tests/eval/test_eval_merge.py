"""``remoe eval`` into a run directory merges: earlier results survive a later, smaller run."""

from __future__ import annotations

import json

from remoe.cli import main

EVAL = ["--limit", "4", "--num-examples", "6", "--batch-size", "4"]


def test_later_evals_merge_and_a_skipped_only_eval_changes_nothing(tiny_run, capsys,
                                                                   no_network):
    res = tiny_run / "eval_results.json"
    assert main(["eval", str(tiny_run), "--tasks", "remoe_lambada,remoe_domain", *EVAL]) == 0
    first = json.loads(res.read_text())
    (m,) = first["models"]
    whole = m["loss"]["loss"]
    assert first["loss_chunks_per_domain"] is None and set(m["zero_shot"]) == {
        "remoe_lambada", "remoe_domain"}

    # every requested task skipped (no HellaSwag on disk): non-zero, nothing touched
    before = (res.read_bytes(), res.with_suffix(".csv").read_bytes())
    capsys.readouterr()
    assert main(["eval", str(tiny_run), "--tasks", "hellaswag", "--no-loss", *EVAL]) == 1
    err = capsys.readouterr().err
    assert "every requested task was skipped (hellaswag)" in err
    assert (res.read_bytes(), res.with_suffix(".csv").read_bytes()) == before

    # a new task adds its score; the old scores and the whole-split loss stay
    assert main(["eval", str(tiny_run), "--tasks", "remoe_hellaswag,arc_easy", "--no-loss",
                 *EVAL]) == 0
    doc = json.loads(res.read_text())
    (m,) = doc["models"]
    assert set(m["zero_shot"]) == {"remoe_lambada", "remoe_domain", "remoe_hellaswag"}
    assert m["zero_shot"]["remoe_lambada"] == first["models"][0]["zero_shot"]["remoe_lambada"]
    assert m["loss"]["loss"] == whole and doc["loss_chunks_per_domain"] is None
    assert [c[0] for c in doc["tasks"]["columns"]] == ["remoe_lambada", "remoe_domain",
                                                       "remoe_hellaswag"]
    assert "arc_easy" in doc["tasks"]["skipped"] and m["averages"]["builtin"] is not None
    csv_head = res.with_suffix(".csv").read_text().splitlines()[0]
    assert "loss" in csv_head.split(",") and "remoe_hellaswag:acc" in csv_head

    # a capped loss never replaces the whole-split one; a scored task is replaced by its rescore
    assert main(["eval", str(tiny_run), "--tasks", "remoe_domain", "--loss-chunks", "1",
                 *EVAL[:2], "--num-examples", "8", "--batch-size", "4"]) == 0
    doc = json.loads(res.read_text())
    (m,) = doc["models"]
    assert m["loss"]["loss"] == whole and doc["loss_chunks_per_domain"] is None
    assert set(m["zero_shot"]) == {"remoe_lambada", "remoe_domain", "remoe_hellaswag"}

    # a whole-split loss recomputed replaces the old one (same model and data: same number)
    assert main(["eval", str(tiny_run), "--tasks", "none", *EVAL]) == 0
    doc = json.loads(res.read_text())
    assert doc["models"][0]["loss"]["loss"] == whole and len(doc["models"][0]["zero_shot"]) == 3
    assert no_network == []
