"""Every bad config is one ConfigError line at load time (exit 2 via the CLI),
before any data or model work; an empty YAML is the documented default run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from remoe.errors import ConfigError
from remoe.experiment import load_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = ROOT / "configs" / "tiny_remoe.yaml"


def _write(tmp_path: Path, text: str | bytes) -> Path:
    p = tmp_path / "exp.yaml"
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return p


def _error(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


# cases that were accepted until the model or optimizer was built (or silently used)
@pytest.mark.parametrize("override, field", [
    ("train.eps=-1", "train.eps"), ("train.eps=nan", "train.eps"), ("train.eps=.nan", "train.eps"),
    ("train.eps=0", "train.eps"), ("run.seed=-1", "run.seed"),
    ("train.weight_decay=.inf", "train.weight_decay"), ("train.grad_clip=inf", "train.grad_clip"),
    ("train.max_flops=.inf", "train.max_flops"),
])
def test_non_finite_and_out_of_range_numbers_are_rejected_at_load(override, field):
    assert _error(None, [override]).startswith(field)


def test_every_float_field_rejects_nan_and_inf():
    import dataclasses

    from remoe.data import DataConfig
    from remoe.experiment import AnalysisConfig, RunConfig, TrainConfig

    fields = [(sec, f.name) for sec, cls in (("run", RunConfig), ("train", TrainConfig),
                                              ("data", DataConfig), ("analysis", AnalysisConfig))
              for f in dataclasses.fields(cls) if "float" in str(f.type)]
    fields += [("model", k) for k in ("lambda0", "alpha", "rope_theta", "init_std", "lb_coeff")]
    assert ("train", "eps") in fields and len(fields) > 10
    for sec, name in fields:
        for bad in ("nan", ".inf", "-.inf"):
            assert _error(None, [f"{sec}.{name}={bad}"]).startswith(f"{sec}.{name}=")


def test_non_finite_numbers_in_the_yaml_file(tmp_path):
    assert _error(_write(tmp_path, "train:\n  eps: .nan\n")).startswith("train.eps=nan")
    assert _error(_write(tmp_path, "run:\n  seed: -1\n")).startswith("run.seed=-1")


@pytest.mark.parametrize("text", ["train: 5\n", "run: [a, b]\n", "model: relu\n",
                                  "analysis: true\n"])
def test_a_section_that_is_not_a_mapping(tmp_path, text):
    section = text.split(":")[0]
    assert _error(_write(tmp_path, text)).startswith(f"section {section} must be a mapping")


def test_non_utf8_yaml(tmp_path):
    msg = _error(_write(tmp_path, b"run:\n  name: caf\xe9\n"))
    assert "is not UTF-8" in msg and "line 2" in msg


def test_out_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for out in (f, f / "sub"):
        msg = _error(None, [f"run.out_dir={out}"])
        assert msg.startswith("run.out_dir=") and "is a file" in msg


def test_run_dir_that_is_a_file(tmp_path):
    (tmp_path / "r").write_text("x")
    assert "is not a directory" in _error(None, [f"run.out_dir={tmp_path}", "run.name=r"])


def test_run_name_must_stay_inside_out_dir(tmp_path):
    for name in ("..", ".", "a/b", "../x", "a\\b", "", "x\ty"):
        assert _error(None, [f"run.out_dir={tmp_path}", f"run.name={name}"]).startswith(
            "run.name="), name


def test_run_name_symlink_escaping_out_dir(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    os.symlink(tmp_path, out / "esc")
    assert "leads outside run.out_dir" in _error(None, [f"run.out_dir={out}", "run.name=esc"])


@pytest.mark.parametrize("text, key", [
    ("run:\n  seed: 1\n  seed: 2\n", "seed"),
    ("train:\n  lr: 1.0e-3\ntrain:\n  lr: 2.0e-3\n", "train"),
])
def test_duplicate_keys_are_errors_naming_key_and_line(tmp_path, text, key):
    msg = _error(_write(tmp_path, text))
    assert f"duplicate key {key!r} at line 3" in msg


def test_yaml_syntax_error_is_one_line_with_position(tmp_path):
    msg = _error(_write(tmp_path, "run: {name: [1\n"))
    assert "not valid YAML" in msg and "line " in msg


def test_empty_yaml_is_the_documented_default_config(tmp_path):
    documented = load_config(DEFAULT_YAML)
    for text in ("", "# nothing here\n", "run:\nmodel:\n"):
        empty = load_config(_write(tmp_path, text))
        for section in ("run", "data", "train", "analysis"):
            assert empty.to_dict()[section] == documented.to_dict()[section], section
        assert (empty.model_config(vocab_size=8192).to_dict()
                == documented.model_config(vocab_size=8192).to_dict())
    # and no file at all is the same experiment
    assert load_config(None).to_dict()["analysis"] == documented.to_dict()["analysis"]
    assert load_config(None).run_dir == documented.run_dir


def test_cli_prints_one_line_and_exits_2_before_any_data_work(tmp_path, capsys):
    from remoe.cli import main

    src = tmp_path / "corpus" / "d"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i} " + "word " * 300)
    cache = tmp_path / "cache"
    small = [f"data.sources=[{src.parent}]", f"data.cache_dir={cache}", "data.vocab_size=300",
             "model.preset=micro", "train.seq_len=32", "train.max_steps=2",
             f"run.out_dir={tmp_path / 'runs'}"]
    rc = main(["train", str(_write(tmp_path, "train:\n  eps: -1\n"))]
              + [a for o in small for a in ("--set", o)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "train.eps=-1" in err
    assert not cache.exists()  # rejected before the data cache was touched
