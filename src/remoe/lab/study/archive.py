"""Committed copies of finished study runs: what survives a new machine.

A study's run directories (checkpoints, weights, logs) live wherever ``--out`` put them, which
may be gone next session. A spec with ``results: DIR`` (relative to the spec) gets every
finished run's small outputs copied to ``DIR/runs/<name>/`` (:func:`export_run`), meant to be
committed with the repository:

* ``config.yaml``, ``summary.json``, ``eval.jsonl``, ``eval_results.json``,
  ``init_from.json`` (a run started from existing weights) as written;
* ``metrics.jsonl.gz``: ``metrics.jsonl`` gzip-compressed (deterministic: no name, mtime 0);
* ``routing.zip``: the calibration-set routing masks (inactive experts, flips), every
  ``masks_<step>.npz`` in one archive (stored as they are, fixed timestamps, sorted: the same
  masks give the same bytes);
* ``study_run.json``: what ``study.json`` knew of the run (wall time over every attempt).

Never checkpoints or weights. :class:`remoe.lab.analysis.runlog.Run` reads such a directory like a
run directory, so tables, curves and the report rebuild from the committed copies alone
(``remoe study SPEC --results-only``), and the runner counts a committed run as done instead of
training it again.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from remoe.lab.analysis.runlog import MASK_FILE, ROUTING_ARCHIVE

#: files copied as they are (those present)
PLAIN_FILES = ("config.yaml", "summary.json", "eval.jsonl", "eval_results.json",
               "init_from.json")
METRICS_GZ = "metrics.jsonl.gz"
RUN_STATE = "study_run.json"
#: what a run's study.json entry contributes to the committed copy
STATE_KEYS = ("total_wall_s", "wall_s", "attempts", "eval_wall_s", "finished")


def committed_dir(results_dir: Path | None, name: str) -> Path | None:
    """``results_dir/runs/<name>`` when it holds a finished run (its summary), else None."""
    if results_dir is None:
        return None
    d = Path(results_dir) / "runs" / name
    return d if (d / "summary.json").is_file() else None


def _gzip_file(src: Path, dst: Path) -> None:
    with src.open("rb") as fin, dst.open("wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as fout:
        shutil.copyfileobj(fin, fout)


def export_run(run_dir: Path, dest: Path, state: dict[str, Any] | None = None) -> Path:
    """Copy the small outputs of the finished run ``run_dir`` to ``dest`` (replaced whole, so
    a copy is never half old and half new). Returns ``dest``."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / "summary.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json (not finished)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name in PLAIN_FILES:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
        if (run_dir / "metrics.jsonl").is_file():
            _gzip_file(run_dir / "metrics.jsonl", tmp / METRICS_GZ)
        pack_masks(run_dir / "routing", tmp / ROUTING_ARCHIVE)
        kept = {k: state[k] for k in STATE_KEYS if state and state.get(k) is not None}
        (tmp / RUN_STATE).write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def pack_masks(routing_dir: Path, archive: Path) -> bool:
    """Write every ``masks_<step>.npz`` of ``routing_dir`` into the one archive ``archive``
    (deterministic bytes); False (nothing written) when there are none."""
    files = sorted(p for p in Path(routing_dir).glob("masks_*.npz") if MASK_FILE.match(p.name))
    if not files:
        return False
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as z:
        for p in files:
            info = zipfile.ZipInfo(p.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, p.read_bytes())
    return True


def pack_committed(run_copy: Path) -> bool:
    """Turn a committed copy's loose ``routing/`` directory (an older layout) into its
    ``routing.zip``; True if it did."""
    loose = Path(run_copy) / "routing"
    if not loose.is_dir() or (Path(run_copy) / ROUTING_ARCHIVE).exists():
        return False
    tmp = Path(run_copy) / f".{ROUTING_ARCHIVE}.tmp"
    if pack_masks(loose, tmp):
        tmp.rename(Path(run_copy) / ROUTING_ARCHIVE)
    shutil.rmtree(loose)
    return True


def up_to_date(run_dir: Path, dest: Path) -> bool:
    """Whether ``dest`` already holds every small file of ``run_dir`` (summary, evaluations,
    config, the init_from record) byte for byte, and its metrics."""
    for name in PLAIN_FILES:
        a, b = Path(run_dir) / name, Path(dest) / name
        if a.is_file() != b.is_file() or (a.is_file() and a.read_bytes() != b.read_bytes()):
            return False
    return (Path(dest) / METRICS_GZ).is_file() or not (Path(run_dir) / "metrics.jsonl").is_file()


def run_state(run_dir: Path) -> dict[str, Any]:
    """The committed ``study_run.json`` of a run copy ({} if absent or unreadable)."""
    try:
        doc = json.loads((Path(run_dir) / RUN_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
