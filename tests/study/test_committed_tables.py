"""Every committed study table is what the code builds from the committed runs today.

``remoe study SPEC --results-only`` rebuilds results.md / results.csv / curves.csv of a study
whose runs are committed (``results: ../../results/<name>`` in the spec) from those runs alone
(docs/RESULTS.md). A change to a definition (what counts as an inactive expert, say) that is not
followed by a rebuild leaves tables in results/ that the code no longer produces: this test
rebuilds each such study into a temporary copy and compares, byte for byte, all but the line
naming the spec and run directories (they depend on where it runs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from remoe.lab.study.results import write_results
from remoe.lab.study.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(p for p in (ROOT / "configs" / "study").glob("*.yaml")
               if (ROOT / "results" / p.stem / "runs").is_dir())


def test_the_studies_with_committed_runs_are_found():
    names = {p.stem for p in SPECS}
    assert {"long", "long_micro", "recipes", "threshold", "e_matched"} <= names, names


def _body(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.startswith("Spec `")]


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_committed_tables_rebuild_identically(spec_path, tmp_path):
    spec = load_spec(spec_path)
    committed = ROOT / "results" / spec_path.stem
    assert spec.results_dir == committed.resolve()
    copy = tmp_path / "results"
    shutil.copytree(committed, copy)
    spec.results_dir = copy  # never write into the checkout
    write_results(spec, tmp_path / "study", None)
    stale = [name for name in ("results.md", "results.csv", "curves.csv")
             if (committed / name).is_file()
             and _body((copy / name).read_text()) != _body((committed / name).read_text())]
    assert not stale, (f"results/{spec_path.stem}: {', '.join(stale)} differ from what the code "
                       f"builds from the committed runs; rebuild: remoe study "
                       f"configs/study/{spec_path.name} --results-only")
