#!/usr/bin/env python3
"""Build a corpus from files the built-in corpus does not use (issue 25, item 5).

    python scripts/unseen_corpus.py OUT_DIR [--max-mb 6]

The built-in corpus (remoe.data.builtin) reads the Python standard library, the Python
documentation, TeX Live documentation, two R packages' texts and the FOLDOC dictionary. This
script gathers three other domains from the installed machine, each a directory of ``.txt``
files that ``data.sources`` takes as ``NAME=DIR``:

* ``pkgcode``: the Python sources of the installed third-party packages (site-packages:
  transformers, torch's Python side, numpy, ...), never the standard library;
* ``licences``: ``/usr/share/common-licenses`` and the ``copyright`` files of
  ``/usr/share/doc`` (legal English);
* ``markdown``: Markdown and reStructuredText files shipped inside site-packages (READMEs,
  package docs), never the Python documentation.

Files are taken in sorted path order until ``--max-mb`` per domain; ``OUT_DIR/manifest.json``
lists every file used with its size and sha256, so a run on the corpus can say what it read.
The corpus depends on what is installed: compare runs on one machine, not across machines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import site
import sys
import sysconfig
from pathlib import Path


def _site_dirs() -> list[Path]:
    dirs = [Path(p) for p in site.getsitepackages()] + [Path(site.getusersitepackages())]
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return sorted({d.resolve() for d in dirs if d.is_dir() and d.resolve() != stdlib})


def _candidates(domain: str) -> list[Path]:
    if domain == "pkgcode":
        return [p for d in _site_dirs() for p in sorted(d.rglob("*.py"))
                if "/remoe" not in p.as_posix() and "/tests/" not in p.as_posix()]
    if domain == "licences":
        common = sorted(Path("/usr/share/common-licenses").glob("*"))
        copyrights = sorted(Path("/usr/share/doc").glob("*/copyright"))
        return [p for p in common + copyrights if p.is_file() and not p.is_symlink()]
    if domain == "markdown":
        return [p for d in _site_dirs() for ext in ("*.md", "*.rst") for p in sorted(d.rglob(ext))
                if "/remoe" not in p.as_posix()]
    raise ValueError(domain)


def build(out: Path, max_bytes: int) -> dict:
    manifest: dict = {"max_bytes_per_domain": max_bytes, "python": sys.version.split()[0],
                      "domains": {}}
    for domain in ("pkgcode", "licences", "markdown"):
        ddir = out / domain
        ddir.mkdir(parents=True, exist_ok=True)
        used, total = [], 0
        for i, path in enumerate(_candidates(domain)):
            try:
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip() or total + len(data) > max_bytes:
                continue
            (ddir / f"{i:06d}.txt").write_text(text, encoding="utf-8")
            used.append({"path": str(path), "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()})
            total += len(data)
        manifest["domains"][domain] = {"files": len(used), "bytes": total, "used": used}
        print(f"{domain}: {len(used)} files, {total / 1e6:.1f} MB -> {ddir}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-mb", type=float, default=6.0, help="bytes per domain (MB)")
    args = ap.parse_args()
    build(args.out, int(args.max_mb * 1e6))
    print("use: --set 'data.sources=[pkgcode=" + str(args.out / "pkgcode") + ", licences="
          + str(args.out / "licences") + ", markdown=" + str(args.out / "markdown") + "]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
