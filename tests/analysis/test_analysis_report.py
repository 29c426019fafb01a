"""Pieces of the HTML report that need no figures: zero-shot results, number formatting."""

from __future__ import annotations

import json

import pytest

from remoe.lab.analysis.report import fmt, table, zero_shot
from remoe.lab.analysis.runlog import Run


def _run(tmp_path, results) -> Run:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "sparsity": 0.5}\n')
    (tmp_path / "eval_results.json").write_text(json.dumps(results))
    return Run(tmp_path)


def test_zero_shot_from_remoe_eval_output(tmp_path):
    # the layout `remoe eval --out` writes: a list of models, headline metric per column
    results = {"tasks": {"columns": [["remoe_lambada", "LAMBADA*", "acc"],
                                     ["remoe_hellaswag", "HellaSwag*", "acc_norm"]]},
               "models": [{"name": "ReMoE", "zero_shot": {
                   "remoe_lambada": {"perplexity": 529.7, "acc": 0.25},
                   "remoe_hellaswag": {"acc,none": 0.4, "acc_norm,none": 0.3}}},
                   {"name": "dMoE", "zero_shot": {}}]}
    zs = zero_shot(_run(tmp_path, results))
    assert zs == {"ReMoE": {"LAMBADA*": pytest.approx(25.0), "HellaSwag*": pytest.approx(30.0)}}


def test_zero_shot_simple_layout_and_absence(tmp_path):
    results = {"models": {"m": {"tasks": {"piqa": 0.61, "arc_e": {"acc": 0.5}, "race": 38.5,
                                          "bad": "n/a"}}}}
    zs = zero_shot(_run(tmp_path, results))
    assert zs == {"m": {"piqa": pytest.approx(61.0), "arc_e": pytest.approx(50.0),
                        "race": pytest.approx(38.5)}}
    (tmp_path / "eval_results.json").unlink()
    assert zero_shot(Run(tmp_path)) == {}


def test_formatting_and_best_cells():
    assert fmt(None) == "–" and fmt(float("nan")) == "–" and fmt(3) == "3"
    assert fmt(104000.0) == "104,000" and fmt(1.676e11) == "1.676e+11" and fmt(0.87654) == "0.8765"
    html = table(["run", "loss"], [["a", 2.0], ["b", 1.5]], best={1: "min"})
    assert '<td class="best">1.5000</td>' in html and '<td class="">2.0000</td>' in html


def test_single_run_report_names_its_numbers(tmp_path, synth):
    import yaml

    from remoe.cli import main

    run = synth.make_run(tmp_path, "one", with_model=False)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["eval_chunks_per_domain"] = 8
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-2])
    summary = json.loads((run / "summary.json").read_text())
    summary["final_lambda"] = last["lambda"] * 1.2  # the trainer's: after the last update
    (run / "summary.json").write_text(json.dumps(summary))
    # what `remoe eval RUN` leaves in the run: one model, whole-split loss, zero-shot
    (run / "eval_results.json").write_text(json.dumps({
        "split": "validation", "loss_chunks_per_domain": None,
        "tasks": {"columns": [["remoe_lambada", "LAMBADA*", "acc"]]},
        "models": [{"name": "one", "loss": {"loss": 3.8123, "split": "validation"},
                    "zero_shot": {"remoe_lambada": {"acc": 0.125}}}]}))
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out), "--no-model"]) == 0
    html = out.read_text()
    # the flip-rate figure once (the run's own), no one-run "comparison" copy
    assert html.count("<figcaption>Flip rate") == 1
    assert "Routing stability" not in html
    # the two validation losses, each named
    assert "final validation (8 sequences per domain, during training) loss" in html
    assert "held-out loss: validation (the whole split, remoe eval)" in html and "3.8123" in html
    # zero-shot results of `remoe eval RUN` in the comparison section
    assert "LAMBADA*" in html and "12.50" in html
    # final lambda: the summary's (next step) with the last step's beside it
    assert "after the last update: the next step" in html
    assert fmt(summary["final_lambda"]) in html
    assert f"used in the last step: {fmt(last['lambda'])}" in html
