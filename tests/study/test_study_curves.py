"""Learning curves (remoe.lab.study.curves) and committed run copies (remoe.lab.study.archive): curve
extraction, the crossover rule, and rebuilding every table and figure from the committed
copies alone, with the run directories (checkpoints included) gone."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from remoe.errors import ConfigError
from remoe.lab.analysis.runlog import run_json
from remoe.lab.study.curves import Curve, crossover, label_curve, run_curve
from remoe.lab.study.runner import Study
from remoe.lab.study.spec import load_spec

STUB = Path(__file__).with_name("stub_train.py")


def _curve(label, loss, x=None, flops=None):
    loss = np.asarray(loss, float)
    x = np.arange(1, loss.size + 1, dtype=float) * 100 if x is None else np.asarray(x, float)
    f = x * 10 if flops is None else np.asarray(flops, float)
    return Curve(label, np.arange(1, loss.size + 1) * 10, x, f, loss)


def _write_run(d: Path, evals, flops_per_step=100.0, steps=10, gz=False):
    d.mkdir(parents=True)
    lines = "".join(json.dumps({"step": s, "flops": s * flops_per_step, "lm_loss": 5.0}) + "\n"
                    for s in range(1, steps + 1))
    if gz:
        (d / "metrics.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    else:
        (d / "metrics.jsonl").write_text(lines)
    (d / "eval.jsonl").write_text("".join(
        json.dumps({"step": s, "tokens": s * 50, "val_loss": v}) + "\n" for s, v in evals))


@pytest.mark.parametrize("gz", [False, True])
def test_run_curve_takes_tokens_from_evals_and_flops_from_metrics(tmp_path, gz):
    _write_run(tmp_path / "r", [(5, 4.0), (10, 3.5)], gz=gz)
    c = run_curve(tmp_path / "r")
    assert c.step.tolist() == [5, 10]
    assert c.tokens.tolist() == [250, 500]
    assert c.flops.tolist() == [500.0, 1000.0]
    assert c.val_loss.tolist() == [4.0, 3.5]


def test_label_curve_is_the_seed_mean_with_the_seed_range_on_shared_steps():
    a = Curve("x", np.array([10, 20, 30]), np.array([1., 2, 3]), np.array([1., 2, 3]),
              np.array([5.0, 4.0, 3.0]))
    b = Curve("x", np.array([10, 20]), np.array([1., 2]), np.array([1., 2]), np.array([6.0, 3.0]))
    m = label_curve("x", [a, b])
    assert m.step.tolist() == [10, 20] and m.seeds == 2
    assert m.val_loss.tolist() == [5.5, 3.5]
    assert m.low.tolist() == [5.0, 3.0] and m.high.tolist() == [6.0, 4.0]


def test_crossover_is_the_first_evaluation_after_which_a_stays_below():
    b = _curve("b", [4.5, 4.5, 3.5, 2.5])
    # below, above, below, below: stays below from the third evaluation
    c = crossover(_curve("a", [4.0, 5.0, 3.0, 2.0]), b)
    assert (c["index"], c["step"], c["x"], c["from_start"], c["never"]) == (2, 30, 300.0,
                                                                             False, False)
    assert c["gap_end"] == pytest.approx(-0.5)
    assert crossover(_curve("a", [4.0, 4.0, 3.0, 2.0]), b)["from_start"] is True
    never = crossover(_curve("a", [4.0, 4.0, 3.0, 2.6]), b)
    assert never["never"] is True and never["step"] is None
    assert never["gap_end"] == pytest.approx(0.1)


def test_crossover_at_matched_flops_interpolates_the_other_curve():
    # B spends twice the FLOPs per token: at A's FLOPs, B's loss is interpolated
    a = _curve("a", [4.0, 3.0, 2.9, 2.8], flops=[100, 200, 300, 400])
    b = _curve("b", [3.5, 3.0, 2.5, 2.0], flops=[200, 400, 600, 800])
    c = crossover(a, b, "flops")
    # A's points at 200/300/400 are compared with B at 200 (3.5), 300 (3.25), 400 (3.0);
    # A's first point (100) lies before B's first evaluation and is not compared
    assert c["compared"] == 3 and c["from_start"] is True
    assert c["gap_end"] == pytest.approx(2.8 - 3.0)
    assert crossover(a, b, "tokens")["never"] is True  # at matched tokens A ends above


def _stub(config_path, flags):
    return [sys.executable, str(STUB), str(config_path), *flags]


def _results_only(spec, out):
    from remoe.lab.study.cli import run

    return run(argparse.Namespace(spec=str(spec), dry_run=False, jobs=1, out=str(out), only=None,
                                  reuse=(), results_only=True, no_report=True, gflops=None))


def _columns(path, keys=("name", "state", "steps", "flops", "val_loss", "wall_s")):
    import csv

    with open(path) as fh:
        return [[row[k] for k in keys] for row in csv.DictReader(fh)]


def test_results_only_rebuilds_from_committed_copies_without_run_directories(write_spec,
                                                                             tmp_path):
    spec = write_spec({"results": "committed", "seeds": [0, 1],
                       "groups": [{"name": "g", "grid": {"model.router": ["topk", "relu"]}}]})
    out = tmp_path / "out"
    assert Study(load_spec(spec), out, command=_stub, log=lambda m: None).run(poll_s=0.02) == 0
    assert _results_only(spec, out) == 0  # copies the finished runs, writes the tables
    committed = tmp_path / "committed"
    for name in ("topk-s0", "topk-s1", "relu-s0", "relu-s1"):
        d = committed / "runs" / name
        assert [p.name for p in d.iterdir()] == ["run.zip"]  # one file per run
        with zipfile.ZipFile(d / "run.zip") as z:
            assert set(z.namelist()) >= {"config.yaml", "summary.json", "eval.jsonl",
                                         "metrics.jsonl", "study_run.json"}
    first = _columns(committed / "results.csv")
    assert (committed / "results.md").is_file() and (committed / "curves.csv").is_file()
    # a new machine: the study directory (runs, checkpoints, study.json) is gone
    shutil.rmtree(out)
    assert _results_only(spec, tmp_path / "elsewhere") == 0
    assert _columns(committed / "results.csv") == first
    md = (committed / "results.md").read_text()
    assert "4 of 4 runs finished" in md and "## Learning curves" in md
    # and the runner counts committed runs as done: nothing is trained again
    again = tmp_path / "again"
    assert Study(load_spec(spec), again, command=_stub, log=lambda m: None).run(
        poll_s=0.02) == 0
    assert not (again / "stub_calls.log").exists()


def test_results_only_without_runs_or_copies_says_so(write_spec, tmp_path):
    spec = write_spec({"results": "committed", "groups": [{"name": "g"}]})
    with pytest.raises(ConfigError, match="no study runs"):
        _results_only(spec, tmp_path / "none")


def test_results_key_must_be_a_path(write_spec):
    with pytest.raises(ConfigError, match="study.results="):
        load_spec(write_spec({"results": 3, "groups": [{"name": "g"}]}))


def test_overtime_windows_read_lambda_share_layers_and_dead_experts(tmp_path):
    from remoe.lab.study.overtime import windows

    d = tmp_path / "r"
    d.mkdir()
    (d / "config.yaml").write_text("model: {preset: micro, router: relu, num_experts: 8, "
                                   "top_k: 1}\n")
    recs = []
    for s in range(1, 13):
        lam = 1e-3 * 10 ** (s // 6)  # 1e-3 in the first half, 1e-2 from step 6, 1e-1 at 12
        recs.append({"step": s, "lr": 1e-3, "lambda": lam, "loss": 5.5, "lm_loss": 5.0,
                     "reg_loss": 0.5 / lam, "layer_sparsity": [0.8, 0.95],
                     "dead_experts": [0, 2 if s > 6 else 0]})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ws = windows(d, n=2)
    assert [w["steps"] for w in ws] == ["1-6", "7-12"]
    assert ws[0]["reg_share"] == pytest.approx(0.5 / 5.5)
    assert ws[0]["lambda"] == pytest.approx((1e-3 ** 5 * 1e-2) ** (1 / 6))
    assert ws[1]["sparsity"] == pytest.approx([0.8, 0.95]) and ws[1]["dev_max"] == pytest.approx(0.075)
    assert ws[0]["dead"] == [0.0, 0.0] and ws[1]["dead"] == [0.0, 2.0]


def _swap_spec(write_spec):
    """A TopK run and a run continued from it with a ReLU router, committed under "committed"."""
    return write_spec({"results": "committed",
                       "base": {"train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 3}},
                       "groups": [
                           {"name": "pre", "runs": [{"label": "topk", "set": {
                               "model.preset": "micro", "model.router": "topk"}}]},
                           {"name": "cont", "runs": [{"label": "swap", "init_from_run": "topk",
                                                      "set": {"model.router": "relu"}}]}]})


def test_continued_runs_section_from_committed_copies(write_spec, tmp_path):
    # the recipes' study: a run started from another's weights gets a row with its source, the
    # first lambda and its rule (init_from.json, committed with the run), and the FLOPs of the
    # run plus its source's
    spec = _swap_spec(write_spec)
    out = tmp_path / "out"
    assert Study(load_spec(spec), out, command=_stub, log=lambda m: None).run(poll_s=0.02) == 0
    rec = {"init_from": str(out / "runs/topk-s0"), "lambda_start": [0.0041],
           "lambda_rule": "gradient balance |g_lm| / |g_reg|",
           "conversion": ["router topk -> relu"]}
    (out / "runs/swap-s0/init_from.json").write_text(json.dumps(rec))  # as remoe train writes
    assert _results_only(spec, out) == 0
    shutil.rmtree(out)  # a new machine: only the committed copies are left
    assert _results_only(spec, tmp_path / "elsewhere") == 0
    md = (tmp_path / "committed" / "results.md").read_text()
    section = md[md.index("## Runs started from other runs' weights"):]
    row = next(line for line in section.splitlines() if line.startswith("| `swap-s0`"))
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip("|"))]  # "\|": in a cell
    assert cells[1] == "`topk-s0`" and cells[2] == "5.000 → 5.000"
    assert cells[8] == r"0.0041 (gradient balance \|g_lm\| / \|g_reg\|)"
    # stub: 1000 FLOPs per step x model.num_experts (unset here: 1), 3 steps each
    assert float(cells[9]) == 2 * 3 * 1000
    assert "\n| `topk-s0`" not in section  # a run from scratch has no row


def test_continued_run_whose_source_is_only_committed_is_skipped_with_the_reason(write_spec,
                                                                               tmp_path):
    # a new machine: the source run is committed (no weights), the continued run is not: it
    # cannot start from a copy without a model, and says so instead of failing in remoe train
    spec = _swap_spec(write_spec)
    out = tmp_path / "out"
    assert Study(load_spec(spec), out, command=_stub, log=lambda m: None).run(poll_s=0.02) == 0
    assert _results_only(spec, out) == 0
    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "committed" / "runs" / "swap-s0")
    logs = []
    again = Study(load_spec(spec), tmp_path / "again", command=_stub, log=logs.append)
    assert again.run(poll_s=0.02) == 1
    text = "\n".join(logs)
    assert ("skipped swap-s0: it starts from the weights of topk-s0, which is only a committed "
            "copy here (no weights)") in text
    assert not (tmp_path / "again" / "stub_calls.log").exists()


def test_each_run_is_copied_the_moment_it_is_done(write_spec, tmp_path):
    """A study cut off after its first run finished still has that run's copy to commit: the
    runner copies each run as it is done, not at the end of the study."""
    spec = write_spec({"results": "committed", "seeds": [0],
                       "groups": [{"name": "g", "grid": {"model.router": ["topk", "relu"]}}]})
    study = Study(load_spec(spec), tmp_path / "out", command=_stub, log=lambda m: None)
    seen = []
    copy = study.copy_to_results

    def watch(r):
        copied = copy(r)
        runs = tmp_path / "committed" / "runs"
        seen.append((r.name, sorted(p.name for p in runs.iterdir())))
        wall = run_json(runs / r.name, "study_run.json")
        assert wall["total_wall_s"] > 0
        return copied

    study.copy_to_results = watch
    assert study.run(poll_s=0.02) == 0
    assert seen == [("topk-s0", ["topk-s0"]), ("relu-s0", ["relu-s0", "topk-s0"])]


def _write_masks(routing: Path, steps, rng) -> None:
    routing.mkdir(parents=True)
    for st in steps:
        m = rng.random((2, 16, 4)) < 0.3
        np.savez_compressed(routing / f"masks_{st:07d}.npz", masks=np.packbits(m, axis=-1),
                            shape=np.array(m.shape), token_ids=np.arange(16),
                            step=np.array(st))


def test_a_committed_copy_is_one_archive_read_like_the_run_directory(tmp_path):
    from remoe.lab.analysis.runlog import Run, load_masks
    from remoe.lab.study.archive import export_run, pack_committed

    run = tmp_path / "run"
    _write_run(run, [(10, 4.0)])
    (run / "summary.json").write_text('{"steps": 10}')
    _write_masks(run / "routing", (0, 5, 10), np.random.default_rng(0))
    loose = [(s, load_masks(m)) for s, m in Run(run).mask_files()]

    a = export_run(run, tmp_path / "copies" / "a")
    b = export_run(run, tmp_path / "copies" / "b")
    assert [p.name for p in a.iterdir()] == ["run.zip"]
    assert (a / "run.zip").read_bytes() == (b / "run.zip").read_bytes()  # deterministic
    packed = [(s, load_masks(m)) for s, m in Run(a).mask_files()]
    assert [s for s, _ in packed] == [s for s, _ in loose] == [0, 5, 10]
    for (_, x), (_, y) in zip(loose, packed):
        assert all(np.array_equal(u, v) for u, v in zip(x, y))
    assert Run(a).summary == {"steps": 10} and Run(a).evals == Run(run).evals
    assert list(Run(a).metrics["lm_loss"]) == list(Run(run).metrics["lm_loss"])

    # an older copy (loose files, metrics.jsonl.gz, the masks loose or in routing.zip) is
    # packed in place, to the bytes export_run writes
    for masks in ("routing", "routing.zip"):
        old = tmp_path / f"old-{masks}"
        shutil.copytree(run, old, ignore=shutil.ignore_patterns("metrics.jsonl"))
        (old / "metrics.jsonl.gz").write_bytes(gzip.compress((run / "metrics.jsonl").read_bytes()))
        (old / "study_run.json").write_text("{}\n")
        if masks == "routing.zip":
            with zipfile.ZipFile(old / "routing.zip", "w") as z:
                for p in sorted((old / "routing").glob("*.npz")):
                    z.write(p, p.name)
            shutil.rmtree(old / "routing")
        assert pack_committed(old) and [p.name for p in old.iterdir()] == ["run.zip"]
        assert (old / "run.zip").read_bytes() == (a / "run.zip").read_bytes()
        assert not pack_committed(old)
    # a file no run copy holds is not packed (nor deleted)
    (old / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        pack_committed(old)