"""Every test file is collected: no directory under tests/ matches pytest's norecursedirs
(whose defaults include ``dist`` and ``build``: a tests/dist/ would silently never run)."""

import fnmatch
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_directory_is_skipped_by_norecursedirs(pytestconfig):
    patterns = pytestconfig.getini("norecursedirs")
    hidden = sorted({str(p.parent.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                     if any(fnmatch.fnmatch(part, pat) for part in p.relative_to(TESTS).parts[:-1]
                            for pat in patterns)})
    assert not hidden, f"never collected (norecursedirs {patterns}): {hidden}"
