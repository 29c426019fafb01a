"""The README's Python snippets run as written (in a temporary working directory), with stdin
closed: none may stop at a question (transformers' "Do you wish to run the custom code?").

Every ```python block of the Quick tour is executed in a fresh interpreter namespace; a block
that raises fails the test. The blocks must stay quick (the `tiny` preset, no download). The
``python - <<'PY'`` programs of the bash blocks run in a subprocess on a micro model saved where
they expect a run's model. The other snippets (they need a trained run or a user's data) are
checked for the one thing that would stop them: an Auto* ``from_pretrained`` of a remoe
directory without ``trust_remote_code=True``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PROMPT = "Do you wish to run the custom code"


def python_blocks(text: str, section: str | None = None) -> list[str]:
    """The ```python blocks of ``text`` (of the ``## section`` only, if given)."""
    if section is not None:
        start = text.index(f"## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_blocks_are_found():
    blocks = python_blocks("x\n## A\n```python\nprint(1)\n```\n```bash\nls\n```\n## B\n"
                           "```python\nprint(2)\n```\n", "A")
    assert blocks == ["print(1)\n"]


QUICK_TOUR = python_blocks(README.read_text(), "Quick tour")


def test_quick_tour_has_snippets():
    assert len(QUICK_TOUR) >= 2


@pytest.mark.parametrize("index", range(len(QUICK_TOUR)))
def test_quick_tour_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a snippet writes lands here
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # closed: a question cannot be answered
    code = QUICK_TOUR[index]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        exec(compile(code, f"README.md Quick tour snippet {index}", "exec"),
             {"__name__": "__main__"})
    printed = out.getvalue()
    assert PROMPT not in printed + err.getvalue()
    assert printed.strip(), "a snippet should show its result"
    if "num_parameters" in code:  # the parameter counts the comment states
        assert printed.splitlines()[0].split() == ["30157056", "8136960"]
    assert list(tmp_path.iterdir()) == []  # nothing left in the working directory


def heredoc_programs(text: str) -> list[str]:
    """The ``python - <<'PY'`` programs inside the ```bash blocks of ``text``."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    return [p for b in blocks for p in re.findall(r"python - <<'PY'\n(.*?)^PY$", b,
                                                    flags=re.S | re.M)]


HEREDOCS = heredoc_programs(README.read_text())


def test_heredoc_programs_are_found():
    assert heredoc_programs("```bash\nx\npython - <<'PY'\nprint(1)\nPY\ny\n```\n") == [
        "print(1)\n"]
    assert HEREDOCS and any("AutoTokenizer" in p for p in HEREDOCS)


@pytest.mark.parametrize("index", range(len(HEREDOCS)))
def test_heredoc_program_runs_with_stdin_closed(index, tmp_path, micro_data_cfg):
    """On a micro model saved as ``runs/tiny-remoe/final`` (what the README's programs load)."""
    import torch

    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.data import prepare_data
    from remoe.train.checkpoint import write_model_dir

    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", vocab_size=384))
    write_model_dir(tmp_path / "runs" / "tiny-remoe" / "final", model,
                    prepare_data(micro_data_cfg, progress=False).tokenizer_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", HEREDOCS[index]], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert PROMPT not in done.stdout + done.stderr
    assert done.stdout.strip()


AUTO_LOAD = re.compile(r"Auto\w+\.from_pretrained\(([^)]*)\)")


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_auto_loads_of_remoe_directories_trust_their_code(doc):
    """An Auto* load of a remoe directory without trust_remote_code=True asks a question on
    stdin (and stops there in a script); every snippet passes it."""
    missing = [m.group(0) for m in AUTO_LOAD.finditer(doc.read_text(encoding="utf-8"))
               if "trust_remote_code=True" not in m.group(1)]
    assert missing == []
