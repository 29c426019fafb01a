"""Committed copies of finished study runs: what survives a new machine.

A study's run directories (checkpoints, weights, logs) live wherever ``--out`` put them, which
may be gone next session. A spec with ``results: DIR`` (relative to the spec) gets every
finished run's small outputs copied to ``DIR/runs/<name>/run.zip`` (:func:`export_run`), one
file per run, meant to be committed with the repository:

* ``config.yaml``, ``summary.json``, ``eval.jsonl``, ``eval_results.json``,
  ``init_from.json`` (a run started from existing weights), ``metrics.jsonl`` as written
  (the text deflated, the masks stored);
* ``routing/masks_<step>.npz``: the calibration-set routing masks (inactive experts, flips);
* ``study_run.json``: what ``study.json`` knew of the run (wall time over every attempt).

Members sorted, fixed timestamps and modes: the same run gives the same bytes. Never
checkpoints or weights. :class:`remoe.lab.analysis.runlog.Run` (and
:func:`~remoe.lab.analysis.runlog.run_bytes`) reads such a directory like a run directory, so
tables, curves and the report rebuild from the committed copies alone (``remoe study SPEC
--results-only``, which also packs copies of the older loose layout: :func:`pack_committed`),
and the runner counts a committed run as done instead of training it again.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path
from typing import Any

from remoe.fileio import atomic_open
from remoe.lab.analysis.runlog import (MASK_FILE, METRICS_GZ, ROUTING_ARCHIVE, RUN_ARCHIVE,
                                       run_bytes, run_has, run_json)

#: files copied as they are (those present)
PLAIN_FILES = ("config.yaml", "summary.json", "eval.jsonl", "eval_results.json",
               "init_from.json", "metrics.jsonl")
RUN_STATE = "study_run.json"
#: what a run's study.json entry contributes to the committed copy
STATE_KEYS = ("total_wall_s", "wall_s", "attempts", "eval_wall_s", "finished")


def committed_dir(results_dir: Path | None, name: str) -> Path | None:
    """``results_dir/runs/<name>`` when it holds a finished run (its summary), else None."""
    if results_dir is None:
        return None
    d = Path(results_dir) / "runs" / name
    return d if run_has(d, "summary.json") else None


def write_archive(members: dict[str, bytes], archive: Path) -> None:
    """``members`` (name -> bytes) as the zip ``archive``, written whole then renamed:
    sorted, fixed timestamps and modes, ``.npz`` stored and the rest deflated."""
    with atomic_open(archive, "wb") as f, zipfile.ZipFile(f, "w") as z:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = (zipfile.ZIP_STORED if name.endswith(".npz")
                                  else zipfile.ZIP_DEFLATED)
            z.writestr(info, members[name], compresslevel=9)


def _masks(routing_dir: Path) -> dict[str, bytes]:
    return {f"routing/{p.name}": p.read_bytes() for p in sorted(Path(routing_dir).glob("*.npz"))
            if MASK_FILE.match(p.name)}


def export_run(run_dir: Path, dest: Path, state: dict[str, Any] | None = None) -> Path:
    """Copy the small outputs of the finished run ``run_dir`` to ``dest/run.zip`` (replaced
    whole, so a copy is never half old and half new). Returns ``dest``."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / "summary.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json (not finished)")
    members = {name: (run_dir / name).read_bytes() for name in PLAIN_FILES
               if (run_dir / name).is_file()}
    members.update(_masks(run_dir / "routing"))
    kept = {k: state[k] for k in STATE_KEYS if state and state.get(k) is not None}
    members[RUN_STATE] = (json.dumps(kept, indent=1, sort_keys=True) + "\n").encode()
    dest.mkdir(parents=True, exist_ok=True)
    write_archive(members, dest / RUN_ARCHIVE)
    return dest


def pack_committed(run_copy: Path) -> bool:
    """Turn a committed copy of an older layout (loose files, ``metrics.jsonl.gz``, the masks
    in ``routing/`` or ``routing.zip``) into its one ``run.zip``, the same members as
    :func:`export_run` writes; True if it did."""
    d = Path(run_copy)
    loose = [p for p in d.iterdir() if p.name != RUN_ARCHIVE and not p.name.startswith(".")]
    if not loose:
        return False
    members = {name: (d / name).read_bytes() for name in (*PLAIN_FILES, RUN_STATE)
               if (d / name).is_file()}
    if (d / METRICS_GZ).is_file():
        members["metrics.jsonl"] = gzip.decompress((d / METRICS_GZ).read_bytes())
    members.update(_masks(d / "routing"))
    if (d / ROUTING_ARCHIVE).is_file():
        with zipfile.ZipFile(d / ROUTING_ARCHIVE) as z:
            members.update({f"routing/{n}": z.read(n) for n in z.namelist()
                            if MASK_FILE.match(n)})
    if (d / RUN_ARCHIVE).is_file():
        with zipfile.ZipFile(d / RUN_ARCHIVE) as z:
            members = {**{n: z.read(n) for n in z.namelist()}, **members}
    known = {*PLAIN_FILES, RUN_STATE, METRICS_GZ, ROUTING_ARCHIVE, "routing"}
    unknown = sorted(p.name for p in loose if p.name not in known)
    if unknown:
        raise FileExistsError(f"{d} holds {', '.join(unknown)}, which a run copy does not")
    write_archive(members, d / RUN_ARCHIVE)
    for p in loose:
        if p.is_dir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
        else:
            p.unlink()
    return True


def up_to_date(run_dir: Path, dest: Path) -> bool:
    """Whether ``dest`` already holds every small file of ``run_dir`` (summary, evaluations,
    config, the init_from record, metrics) byte for byte."""
    for name in PLAIN_FILES:
        a = Path(run_dir) / name
        b = run_bytes(dest, name)
        if a.is_file() != (b is not None) or (b is not None and a.read_bytes() != b):
            return False
    return True


def run_state(run_dir: Path) -> dict[str, Any]:
    """The committed ``study_run.json`` of a run copy ({} if absent or unreadable)."""
    doc = run_json(run_dir, RUN_STATE)
    return doc if isinstance(doc, dict) else {}
