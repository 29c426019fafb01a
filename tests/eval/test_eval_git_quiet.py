"""``remoe eval`` outside a git repository prints no "fatal: not a git repository": lm-eval
records the working directory's git commit by running git with the terminal as its stderr."""

import shutil

import pytest

pytest.importorskip("lm_eval")


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_lm_eval_git_hash_is_quiet_outside_a_repository(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator as ev

    from remoe.eval.zeroshot import _quiet_git_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    ev.get_git_commit_hash()  # lm-eval's own: git's complaint reaches the terminal
    assert "not a git repository" in capfd.readouterr().err
    with _quiet_git_hash():
        assert ev.get_git_commit_hash() is None
    assert "not a git repository" not in capfd.readouterr().err
    assert ev.get_git_commit_hash.__module__ == "lm_eval.loggers.utils"  # put back
