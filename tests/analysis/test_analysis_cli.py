"""``remoe analyze`` and ``remoe report`` end to end on synthetic runs (+ a micro model).

The numbers in the written CSV/JSON are checked against independent computations; the PNGs
for being real, 150+ dpi images.
"""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
from PIL import Image

from remoe.lab.analysis.analyze import flip_series
from remoe.lab.analysis.cli import parse_items
from remoe.lab.analysis.runlog import Run, load_masks
from remoe.errors import ConfigError


def cli(command: str, argv: list[str]) -> int:
    """``remoe <command> argv`` through the real entry point."""
    from remoe.cli import main

    return main([command, *argv])


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path, min_width=600):
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] >= min_width
        dpi = im.info.get("dpi", (0, 0))[0]
        assert dpi >= 150


def test_commands_are_wired():
    from remoe.cli import COMMANDS

    assert COMMANDS["analyze"][0] == "remoe.lab.analysis.cli"
    assert COMMANDS["report"][0] == "remoe.lab.analysis.report_cli"


def test_parse_items():
    assert parse_items(["flips", "a", "b"], None) == (("flips",), ["a", "b"])
    assert parse_items(["stages,heatmap", "a"], None) == (("stages", "heatmap"), ["a"])
    assert parse_items(["a"], "flips")[0] == ("flips",)
    assert len(parse_items(["a"], None)[0]) == 8  # every analysis, experts and gates included
    with pytest.raises(ConfigError, match="unknown analysis"):
        parse_items(["a"], "flops")
    with pytest.raises(ConfigError, match="no run"):
        parse_items(["flips"], None)


def test_analyze_all(remoe_run, eval_npz, synth, capsys):
    rc = cli("analyze", [str(remoe_run), "--data", str(eval_npz), "--min-count", "2",
                         "--settle-tol", "0.01", "--smooth", "1"])  # the hand values' options
    assert rc == 0
    out = remoe_run / "analysis"
    printed = capsys.readouterr().out
    assert "settling time 60 steps" in printed

    st = json.loads((out / "stages.json").read_text())
    assert (st["stage2_start"], st["settle_step"], st["settling_time"]) == (31, 61, 60)
    rows = read_csv(out / "stages.csv")
    assert len(rows) == synth.NUM_STEPS and rows[45]["stage"] == "2"

    sp = json.loads((out / "sparsity.json").read_text())
    s = synth.sparsity_curve()
    assert sp["skip_steps"] == 100 and sp["mean"] == pytest.approx(s[100:].mean(), abs=1e-9)
    assert sp["layer_mean"][1] - sp["layer_mean"][0] == pytest.approx(0.02)

    flips = read_csv(out / "flips.csv")
    ref = flip_series(Run(remoe_run).mask_files())
    assert [int(r["step"]) for r in flips] == ref.steps == [10, 20, 30, 40]
    assert np.allclose([float(r["flip_rate"]) for r in flips], ref.rates, atol=1e-6)
    assert np.allclose([float(r["flip_count"]) for r in flips], np.array(ref.rates) * synth.E,
                       atol=1e-5)
    assert 0.005 < ref.rates[0] < 0.04  # masks were flipped with p = 0.02

    ratio = read_csv(out / "routed_ratio.csv")
    hm = json.loads((out / "routed_ratio.json").read_text())
    per_layer = [sum(float(r["routed_ratio"]) for r in ratio if r["layer"] == str(l))
                 for l in range(synth.LAYERS)]
    assert np.allclose(per_layer, hm["active_experts_per_layer"], atol=1e-5)

    spec = json.loads((out / "specialization.json").read_text())
    assert spec["domains"] == ["code", "prose"]
    rows = read_csv(out / "specialization.csv")
    r = np.array([float(x["routed_ratio"]) for x in rows]).reshape(2, synth.LAYERS, synth.E)
    mean, std = r.mean(0), r.std(0)
    assert spec["index"] == pytest.approx(np.mean(std[mean > 0] / mean[mean > 0]), abs=1e-4)

    tokens = read_csv(out / "token_allocation.csv")
    active = [float(t["mean_active"]) for t in tokens]
    assert active == sorted(active, reverse=True) and min(int(t["count"]) for t in tokens) >= 2
    top = read_csv(out / "top_tokens.csv")
    assert top and all(float(t["prob"]) == pytest.approx(int(t["routed"]) / int(t["count"]),
                                                         abs=1e-5) for t in top)
    assert any(t["token"].strip() for t in top)  # decoded with the run's tokenizer.json

    # expert use: balanced counts (32 per expert and step) and the last recorded masks
    ex = json.loads((out / "expert_use.json").read_text())
    assert ex["train"]["effective_experts"] == pytest.approx([synth.E] * synth.LAYERS)
    assert ex["train"]["experts_per_token"] == pytest.approx([1.0] * synth.LAYERS)
    assert ex["train"]["never_firing"] == [0.0] * synth.LAYERS
    step, last = Run(remoe_run).mask_files()[-1]
    m_LTN = load_masks(last)[0]
    assert ex["calib"]["step"] == step and ex["calib"]["no_expert_share"] == pytest.approx(
        (~m_LTN.any(2)).mean(1).tolist())
    assert ex["calib"]["inactive"] == (m_LTN.mean(1) < 0.25 / synth.E).sum(1).tolist()
    assert "expert use per layer" in printed and "layer 1:" in printed
    assert hm["inactive_rule"] == "fair" and hm["inactive_threshold"] == pytest.approx(
        0.25 / synth.E)  # k = 1
    assert len(hm["no_expert_share_per_layer"]) == synth.LAYERS
    assert all(0.0 <= v <= 1.0 for v in hm["no_expert_share_per_layer"])
    assert hm["inactive_per_layer"] and sum(hm["inactive_per_layer"]) == hm["num_inactive"]

    for png in ("stages", "sparsity", "layer_sparsity", "flips", "routed_ratio", "specialization",
                "allocation_tokens", "allocation_domains", "top_tokens_layer0"):
        assert_png(out / f"{png}.png")
    assert (out / "routing_stats.npz").is_file() and (out / "analysis.json").is_file()


def test_routing_stats_are_cached(remoe_run, eval_npz, tmp_path):
    from remoe.lab.analysis.analyze import Options, routing_stats

    cache = tmp_path / "routing_stats.npz"
    opts = Options(data=str(eval_npz))
    first, names = routing_stats(Run(remoe_run), opts, cache)
    before = cache.stat().st_mtime_ns
    again, _ = routing_stats(Run(remoe_run), opts, cache)  # same inputs: read back
    assert cache.stat().st_mtime_ns == before and names.available
    assert again.domains == ["code", "prose"] and np.array_equal(again.counts_DLN,
                                                                 first.counts_DLN)
    fewer, _ = routing_stats(Run(remoe_run), Options(data=str(eval_npz), max_tokens=64), cache)
    assert fewer.num_tokens == 64 and cache.stat().st_mtime_ns != before  # new budget: new pass


def test_flips_of_two_runs(remoe_run, topk_run, tmp_path):
    rc = cli("analyze", ["flips", str(remoe_run), str(topk_run), "--out", str(tmp_path)])
    assert rc == 0
    rows = read_csv(tmp_path / "flips_compare.csv")
    mean = {name: np.mean([float(r["flip_rate"]) for r in rows if r["run"] == name])
            for name in ("remoe-syn", "moe-syn")}
    assert mean["moe-syn"] > 2 * mean["remoe-syn"]  # flipped with p = 0.08 vs 0.02
    assert_png(tmp_path / "flips_compare.png")
    assert not (tmp_path / "stages.png").exists()


def test_requested_but_impossible_analysis(topk_run, tmp_path, capsys):
    # no model in this run: asking for the heatmap explicitly fails with status 1
    assert cli("analyze", ["heatmap", str(topk_run), "--out", str(tmp_path)]) == 1
    assert "skipped" in capsys.readouterr().out
    assert cli("analyze", [str(tmp_path)]) == 2  # not a run directory: one-line error
    assert "holds no run" in capsys.readouterr().err


def test_report(remoe_run, topk_run, eval_npz, tmp_path):
    tasks = {"arc_easy": 0.42, "piqa": {"acc": 0.6, "acc_norm": 0.61}}
    results = {"models": {"moe-syn": {"tasks": tasks}}}
    (topk_run / "eval_results.json").write_text(json.dumps(results))
    out = tmp_path / "report.html"
    rc = cli("report", [str(remoe_run), str(topk_run), "--out", str(out),
                                           "--data", str(eval_npz), "--min-count", "2"])
    assert rc == 0
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "http://" not in html and "https://" not in html  # self-contained
    assert html.count("data:image/png;base64,") >= 12
    for text in ("remoe-syn", "moe-syn", "settling time", "Validation loss per domain",
                 "specialisation index", "arc_easy", "42.00", "60.00", "prose"):
        assert text in html
    # the comparison table lists both runs' validation loss (3.9)
    assert len(re.findall(r"3\.9000", html)) >= 2
    # settling time: the ReLU run's 60 steps; the TopK run's sparsity is fixed by the router,
    # so n/a as in its training summary, not a settling time of 0
    assert "n/a (sparsity fixed by the router)" in html
    rows = re.findall(r"<tr>(.*?)</tr>", html, flags=re.S)
    topk_row = next(r for r in rows if ">moe-syn<" in r and ">topk<" in r)
    assert "n/a (sparsity fixed by the router)" in topk_row
    relu_row = next(r for r in rows if ">remoe-syn<" in r and ">relu<" in r)
    assert "n/a" not in relu_row and ">61<" in relu_row  # report defaults: tol 0.02


def test_misspelt_analysis_is_named(remoe_run, capsys):
    assert cli("analyze", ["stagez", str(remoe_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown analysis 'stagez' (did you mean stages?)" in err
    assert "not a directory" not in err
    with pytest.raises(ConfigError, match=r"'flipz' \(did you mean flips\?\)"):
        parse_items(["stages,flipz", str(remoe_run)], None)
    with pytest.raises(ConfigError, match=r"did you mean heatmap"):
        parse_items([str(remoe_run)], "heatmpa")
    # a missing run directory is still reported as such
    with pytest.raises(ConfigError, match="not a directory"):
        cli_items = parse_items(["runs/nosuch"], None)[1]
        Run(cli_items[0])


def _capture_figures(monkeypatch):
    """Record every figure the analyses save: file name -> all its texts."""
    from remoe.lab.analysis import plots

    texts: dict[str, str] = {}
    real = plots.save_png

    def save(fig, path):
        found = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
        found += [c.get_text().get_text() for ax in fig.axes for tab in ax.tables
                  for c in tab.get_celld().values()]
        texts[path.name] = "\n".join(x for x in found if isinstance(x, str))
        return real(fig, path)

    monkeypatch.setattr(plots, "save_png", save)
    return texts


def test_figures_say_which_layers_and_statistic(remoe_run, eval_npz, tmp_path, monkeypatch):
    texts = _capture_figures(monkeypatch)
    rc = cli("analyze", ["specialization,allocation", str(remoe_run), "--data", str(eval_npz),
                         "--min-count", "2", "--layers", "1", "--out", str(tmp_path)])
    assert rc == 0
    note = "only layers 1 of MoE layers 0-1 shown (chosen with --layers)"
    assert note in texts["specialization.png"] and note in texts["top_tokens_layer1.png"]
    assert "top_tokens_layer0.png" not in texts
    top = texts["top_tokens_layer1.png"]
    assert "share of the expert's tokens" in top and "lift" in top and "×" in top
    rows = read_csv(tmp_path / "top_tokens.csv")
    assert rows and all(float(r["lift"]) > 1 for r in rows)
    for r in rows:
        assert float(r["lift"]) == pytest.approx(float(r["share"]) / float(r["base"]), rel=1e-4)
    # within an expert, ranked by share - base frequency
    by = {}
    for r in rows:
        by.setdefault(r["expert"], []).append(float(r["share"]) - float(r["base"]))
    assert all(v == sorted(v, reverse=True) for v in by.values())
    al = json.loads((tmp_path / "allocation.json").read_text())
    assert al["layers_plotted"] == [1] and al["num_layers"] == 2


def test_allocation_annotation_is_outside_the_data():
    from remoe.lab.analysis.plots_routing import fig_token_allocation

    n = 60
    table = {"token_id": np.arange(n), "mean_active": np.linspace(3, 1, n),
             "frequency": np.geomspace(1e-2, 1e-4, n)}
    fig = fig_token_allocation(table, lambda i: f"tok{i}", 0.5, 1, "t")
    fig.canvas.draw()
    ax = fig.axes[0]
    (note,) = [t for a in fig.axes for t in a.texts if "most experts" in t.get_text()]
    box = note.get_window_extent()
    assert box.y1 <= ax.get_window_extent().y0  # below the axes: no data point can cover it
    assert box.x0 >= 0 and box.y0 >= 0  # still on the canvas


def test_stages_reports_the_last_excursion(tmp_path, synth, capsys):
    run = synth.make_run(tmp_path, "exc", with_model=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in recs:  # in the band from 61, out of it for steps 80-90, back in from 91
        if 80 <= r["step"] <= 90:
            r["sparsity"] = synth.TARGET - 0.06
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli("analyze", ["stages", str(run), "--smooth", "1"]) == 0
    st = json.loads((run / "analysis" / "stages.json").read_text())
    assert st["settle_step"] == 91 and st["band_excursions"] == [[80, 90]]
    assert st["stage3_steps"] == synth.NUM_STEPS - 90
    out = capsys.readouterr().out
    assert "stage III from 91" in out and "last at steps 80-90" in out
    # the trainer's end-of-run summary uses the same detection (same defaults)
    from remoe.train.metrics import logged_stages

    assert cli("analyze", ["stages", str(run)]) == 0  # the defaults, as the trainer
    st = json.loads((run / "analysis" / "stages.json").read_text())
    assert logged_stages(run, synth.TARGET).settle_step == st["settle_step"] > 90


def test_expert_use_at_a_recorded_step(remoe_run, tmp_path):
    """``--mask-step``: expert use as the run was at that step (runs cut at different steps
    compare there): the training window ends at it, the masks are that step's."""
    steps = [s for s, _ in Run(remoe_run).mask_files()]
    assert len(steps) >= 2
    at = steps[len(steps) // 2]
    out = tmp_path / "at"
    assert cli("analyze", ["experts", str(remoe_run), "--mask-step", str(at),
                           "--out", str(out)]) == 0
    ex = json.loads((out / "expert_use.json").read_text())
    assert ex["calib"]["step"] == at
    first, last = ex["train"]["steps"]
    logged = [r["step"] for r in Run(remoe_run).metrics.records if r.get("expert_counts")]
    assert last == max(s for s in logged if s <= at) and first <= last
    whole = tmp_path / "whole"
    assert cli("analyze", ["experts", str(remoe_run), "--out", str(whole)]) == 0
    assert json.loads((whole / "expert_use.json").read_text())["calib"]["step"] == steps[-1]


def test_expert_use_at_a_step_without_masks_says_so(remoe_run, tmp_path, capsys):
    steps = [s for s, _ in Run(remoe_run).mask_files()]
    missing = steps[0] + 1
    assert missing not in steps
    cli("analyze", ["experts", str(remoe_run), "--mask-step", str(missing),
                    "--out", str(tmp_path / "x")])
    assert f"no routing masks of step {missing}" in capsys.readouterr().out
    assert not (tmp_path / "x" / "expert_use.json").exists()
