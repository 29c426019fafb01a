"""``remoe study --reuse``: finished runs of other studies that are the same experiment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError
from remoe.lab.study.children import read_yaml, same_experiment


def finished_runs(study_dirs, exclude: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(run directory, :func:`same_experiment` of its config) of every finished run (one with a
    ``summary.json``) under ``<dir>/runs/`` of each study directory, except those in
    ``exclude`` (the study's own runs)."""
    out = []
    for study_dir in study_dirs:
        for summary in sorted(Path(study_dir).glob("runs/*/summary.json")):
            src = summary.parent.resolve()
            if src.parent == Path(exclude).resolve():
                continue
            cfg = read_yaml(src / "config.yaml")
            if not cfg:
                continue
            try:
                out.append((src, same_experiment(cfg)))
            except ConfigError:
                continue  # a run of an older remoe this one cannot read: not the same
    return out


def take_over(src: Path, dst: Path) -> None:
    """Copy a finished run directory to ``dst`` (absent or empty), hard-linking each file
    where the file system allows (no extra disk for checkpoints)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.rmdir()
    shutil.copytree(src, dst, copy_function=_link_or_copy)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
        return dst
    except OSError:
        return shutil.copy2(src, dst)


def adopt_identical(study, selected) -> None:
    """``remoe study --reuse DIR``: a run of ``study`` not started here whose experiment
    (config minus run name and directory; seed included) finished in another study is taken
    over, hard-linked where the file system allows, instead of being trained again. In
    dependency order (``selected``), so a FLOP-matched run can match its adopted reference."""
    found = study.finished_elsewhere()
    for r in selected:
        d = study.run_dir(r)
        if study.trained(r) or study.has_checkpoint(r) or (d.exists() and any(d.iterdir())):
            continue
        if (r.match_of and study.match_flops(r) is None) or r.init_of:
            continue  # no stop point yet, or weights of this study's own run
        want = same_experiment(study.full_config(r))
        src = next((p for p, cfg in found if cfg == want), None)
        if src is None:
            continue
        take_over(src, d)
        study.log(f"  reuse {r.name}  <- {src} (the same experiment, finished)")
        st = study.states[r.name]
        st.state, st.message = ("done" if study.done(r) else "pending"), f"reused from {src}"
