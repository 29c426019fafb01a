"""Finishing is idempotent: ``--resume`` of a finished run, or of one stopped after its last
checkpoint but before ``final/``, adds no duplicate line and writes a complete summary.json;
NaN/inf never reach a JSON file."""

import json
import shutil

import pytest

from remoe.cli import main
from remoe.experiment import load_config
from remoe.train.trainer import Trainer


def _strict(path):
    def no_constant(name):
        raise AssertionError(f"{name} in {path}")

    return json.loads(path.read_text(), parse_constant=no_constant)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, train_argv):
    out = tmp_path_factory.mktemp("finish")
    assert main(train_argv(out, "f")) == 0
    return out / "f"


@pytest.mark.parametrize("stopped", ["finished", "before_final"])
def test_resume_after_the_last_checkpoint(finished, stopped, tmp_path, train_argv, rd, capsys):
    run = tmp_path / "f"
    shutil.copytree(finished, run)
    if stopped == "before_final":  # killed between the last checkpoint and final/
        shutil.rmtree(run / "final")
        (run / "summary.json").unlink()
    before = _strict(finished / "summary.json")
    assert main(train_argv(tmp_path, "f", "--resume")) == 0
    assert [e["step"] for e in rd.read_jsonl(run / "eval.jsonl")] == [3, 6]  # no duplicate
    assert rd.read_jsonl(run / "eval.jsonl") == rd.read_jsonl(finished / "eval.jsonl")
    assert rd.read_jsonl(run / "metrics.jsonl") == rd.read_jsonl(finished / "metrics.jsonl")
    summary = _strict(run / "summary.json")
    last = rd.read_jsonl(run / "metrics.jsonl")[-1]
    assert summary["final_lm_loss"] == last["lm_loss"] and summary["final_lm_loss"] is not None
    assert summary["final_sparsity"] == last["sparsity"]
    for key in ("steps", "tokens", "val_loss", "val_domains", "final_lambda", "params_total"):
        assert summary[key] == before[key], key
    assert rd.same_weights(rd.weights(run), rd.weights(finished))
    # nothing re-checkpointed: the step-6 checkpoint is the one written by the first run
    assert ((run / "checkpoints" / "step_0000006" / "checksums.json").read_text()
            == (finished / "checkpoints" / "step_0000006" / "checksums.json").read_text())


def test_nan_is_written_as_null(tmp_path, train_argv, rd, monkeypatch):
    """A NaN validation loss (e.g. an empty validation split) gives null, valid JSON."""
    import remoe.model.losses as loss_mod

    def nan_loss(model, batches, domains, device="cpu"):
        return {"loss": float("nan"), "ppl": float("inf"),
                "domains": {d: {"loss": float("nan")} for d in domains}}

    monkeypatch.setattr(loss_mod, "evaluate_loss", nan_loss)
    argv = train_argv(tmp_path, "n", **{"train.max_steps": 2, "train.eval_every": 1})
    overrides = [a.removeprefix("--set=") for a in argv if a.startswith("--set=")]
    summary = Trainer(load_config(None, overrides), progress=False).train()
    assert summary["val_loss"] != summary["val_loss"]  # NaN in memory
    evals = [_strict_line(x) for x in (tmp_path / "n" / "eval.jsonl").read_text().splitlines()]
    assert [e["val_loss"] for e in evals] == [None, None] and evals[0]["val_ppl"] is None
    s = _strict(tmp_path / "n" / "summary.json")
    assert s["val_loss"] is None and set(s["val_domains"].values()) == {None}


def _strict_line(line):
    def no_constant(name):
        raise AssertionError(f"{name} in {line[:80]}")

    return json.loads(line, parse_constant=no_constant)


@pytest.mark.parametrize("name", ["eval.jsonl", "metrics.jsonl"])
def test_torn_last_line_is_dropped_with_a_warning(name, tmp_path, capsys):
    from remoe.train.metrics import MetricsWriter

    path = tmp_path / name
    good = [{"step": 3, "val_loss": 5.9}, {"step": 6, "val_loss": 5.8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 9, "val_lo')
    w = MetricsWriter(path, resume_step=6)
    assert w.last == good[-1]
    w.write({"step": 7, "val_loss": 5.7})
    w.close()
    err = capsys.readouterr().err
    assert f"warning: dropped 1 unreadable line(s) of {path} (line 3" in err
    assert [json.loads(x) for x in path.read_text().splitlines()] == good + [{"step": 7,
                                                                             "val_loss": 5.7}]
