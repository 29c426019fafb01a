"""``--set KEY VALUE`` (a missing ``=``) is named as such, in one line, before any work."""

import pytest

from remoe.errors import ConfigError

from remoe.cli import main


@pytest.mark.parametrize("argv, hint", [
    (["train", "--set", "model.num_experts", "16"], "did you mean --set model.num_experts=16?"),
    (["train", "--set", "train.max_steps=5", "--set", "train.lr", "1e-3"],
     "did you mean --set train.lr=1e-3?"),
    (["train", "--set", "train.max_steps"], "did you mean --set train.max_steps=VALUE?"),
    (["data", "--set", "data.vocab_size", "512"], "did you mean --set data.vocab_size=512?"),
])
def test_set_without_equals_names_the_slip(argv, hint, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(hint), err
    assert "has no '='" in err[0] and "does not exist" not in err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_well_formed_set_is_untouched():
    from remoe.configfile import check_set_syntax

    assert check_set_syntax(None, ["model.num_experts=16", "train.lr=1e-3"]) is None
    with pytest.raises(ConfigError, match="did you mean --set train.lr=VALUE"):
        check_set_syntax(None, ["model.num_experts=16", "train.lr"])
