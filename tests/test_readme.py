"""The README's Python snippets run as written (in a temporary working directory).

Every ```python block of the Quick tour is executed in a fresh interpreter namespace; a block
that raises fails the test. The blocks must stay quick (the `tiny` preset, no download).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


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
    code = QUICK_TOUR[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md Quick tour snippet {index}", "exec"),
             {"__name__": "__main__"})
    printed = out.getvalue()
    assert printed.strip(), "a snippet should show its result"
    if "num_parameters" in code:  # the parameter counts the comment states
        assert printed.splitlines()[0].split() == ["30157056", "8136960"]
    assert list(tmp_path.iterdir()) == []  # nothing left in the working directory
