"""Each bad input is one line, exit 2, before any
data or model work, with nothing left behind; a run killed before its first checkpoint leads
somewhere from both commands; a torn last metrics line is restored from the checkpoint."""

import json
import shutil

import pytest

from remoe.cli import main

FAST = {"train.max_steps": 2, "train.eval_every": 0}


@pytest.fixture
def no_data(monkeypatch):
    import remoe.data

    def refuse(*a, **k):
        raise AssertionError("data was prepared")

    monkeypatch.setattr(remoe.data, "prepare_data", refuse)


def _one_line(capsys, code, *needles):
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("remoe train: error: "), err
    for n in needles:
        assert n in err[0], err
    return err[0]


@pytest.mark.parametrize("field,value,needle", [
    ("run.name", "x" * 300, "run.name="),
    ("run.out_dir", "/proc/remoe-test/runs", "run.out_dir"),
    ("train.micro_batch_size", 1_000_000_000, "train.micro_batch_size"),
    ("model.hidden_size", 1_000_000, "model.hidden_size"),
    ("model.num_experts", 1_000_000, "model.num_experts"),
    ("model.vocab_size", 100, "model.vocab_size=100"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, train_argv, capsys, no_data, field,
                                               value, needle):
    argv = train_argv(tmp_path, "r", **{**FAST, field: value})
    _one_line(capsys, main(argv), needle)
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing to --overwrite later


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys, no_data):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert len(bomb.read_bytes()) < 700
    import time

    t0 = time.monotonic()
    code = main(["train", str(bomb)])
    assert time.monotonic() - t0 < 10
    _one_line(capsys, code, "YAML aliases", str(bomb))


def test_run_killed_before_its_first_checkpoint_leads_to_overwrite(tmp_path, train_argv,
                                                                   capsys, no_data):
    run = tmp_path / "k"
    run.mkdir()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _one_line(capsys, main(train_argv(tmp_path, "k", **FAST)), "before its first checkpoint",
              "--overwrite")
    msg = _one_line(capsys, main(train_argv(tmp_path, "k", "--resume", **FAST)),
                    "no checkpoint", "--overwrite")
    assert "--resume" not in msg.split(";")[-1]
    _one_line(capsys, main(train_argv(tmp_path, "new", "--resume", **FAST)),
              "has not been started", "without --resume")


def test_torn_last_metrics_line_is_restored_on_resume(tmp_path, train_argv, capsys, rd):
    assert main(train_argv(tmp_path, "t", **FAST)) == 0
    run = tmp_path / "t"
    before = json.loads((run / "summary.json").read_text())
    good = (run / "metrics.jsonl").read_text()
    lines = good.splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    capsys.readouterr()
    assert main(train_argv(tmp_path, "t", "--resume", **FAST)) == 0
    err = capsys.readouterr().err
    assert "restored it from the checkpoint" in err, err
    after = json.loads((run / "summary.json").read_text())
    assert after["final_lm_loss"] is not None
    assert after["final_lm_loss"] == before["final_lm_loss"]
    assert rd.strip_timing(rd.read_jsonl(run / "metrics.jsonl")) == rd.strip_timing(
        [json.loads(x) for x in good.splitlines()])
