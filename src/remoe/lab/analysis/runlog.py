"""Reading a run directory (the layout of docs/ARCHITECTURE.md) for the analyses and the report.

Everything is read lazily and cached on the :class:`Run`: ``metrics.jsonl`` as column arrays,
``eval.jsonl``, ``config.yaml``, ``summary.json``, ``eval_results.json`` and the
``routing/masks_<step>.npz`` series. A committed study copy keeps the same files in one
``run.zip`` (:mod:`remoe.lab.study.archive`); :func:`run_bytes` reads a file from either. A
truncated last JSONL line (a run still writing) is skipped; when a resumed run logged a step
twice the last record of that step wins.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from remoe.errors import ConfigError

MASK_FILE = re.compile(r"^masks_(\d+)\.npz$")
#: a committed study copy: every small file of the run in this one archive, the masks as
#: ``routing/masks_<step>.npz`` members
RUN_ARCHIVE = "run.zip"
#: the older committed layouts: loose files, ``metrics.jsonl.gz``, the masks in ``routing.zip``
ROUTING_ARCHIVE = "routing.zip"
METRICS_GZ = "metrics.jsonl.gz"


def run_bytes(run_dir: Path, name: str) -> bytes | None:
    """The file ``name`` of a run: ``run_dir/name``, else the member ``name`` of
    ``run_dir/run.zip`` (a committed study copy); None when neither exists."""
    path = Path(run_dir) / name
    if path.is_file():
        return path.read_bytes()
    packed = Path(run_dir) / RUN_ARCHIVE
    if not packed.is_file():
        return None
    with zipfile.ZipFile(packed) as z:
        return z.read(name) if name in z.NameToInfo else None


def run_has(run_dir: Path, name: str) -> bool:
    """Whether the run has the file ``name`` (loose, or in its ``run.zip``)."""
    if (Path(run_dir) / name).is_file():
        return True
    packed = Path(run_dir) / RUN_ARCHIVE
    if not packed.is_file():
        return False
    with zipfile.ZipFile(packed) as z:
        return name in z.NameToInfo


def run_json(run_dir: Path, name: str) -> Any:
    """The JSON file ``name`` of a run (:func:`run_bytes`); None if absent or unparseable."""
    data = run_bytes(run_dir, name)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def run_jsonl(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The records of the JSONL file ``name`` of a run (:func:`run_bytes`; an older committed
    copy's gzip-compressed ``name.gz``); [] when absent. A line that does not parse (one being
    written) is skipped."""
    data = run_bytes(run_dir, name)
    gz = Path(run_dir) / f"{name}.gz"
    if data is None and gz.is_file():
        try:
            data = gzip.decompress(gz.read_bytes())
        except (OSError, EOFError):
            return []
    out = []
    for line in (data or b"").decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per ``step`` (the last written), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if "step" in r:
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


class Metrics:
    """``metrics.jsonl`` as columns: ``m["sparsity"]`` is a float array aligned with ``m.steps``."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = last_per_step(records)
        self.steps = np.asarray([int(r["step"]) for r in self.records], dtype=np.int64)
        self._cols: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: str) -> np.ndarray:
        """float64 column (NaN where a record lacks the key or holds null)."""
        if key not in self._cols:
            vals = [r.get(key) for r in self.records]
            ok = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals]
            self._cols[key] = np.array([float(v) if o else math.nan for v, o in zip(vals, ok)],
                                       dtype=np.float64)
        return self._cols[key]

    def has(self, key: str) -> bool:
        return bool(np.isfinite(self[key]).any()) if len(self) else False

    def layer_sparsity(self) -> np.ndarray:
        """[steps, L] per-layer sparsity (NaN rows where missing); [steps, 0] if never logged."""
        return self.per_layer("layer_sparsity")

    def per_layer(self, key: str) -> np.ndarray:
        """[steps, L] of a per-layer list column (``layer_sparsity``, ``lambda_layers``,
        ``dead_experts``, ...): NaN rows where missing; [steps, 0] if never logged."""
        rows = [r.get(key) for r in self.records]
        L = max((len(x) for x in rows if isinstance(x, list)), default=0)
        out = np.full((len(rows), L), np.nan)
        for i, x in enumerate(rows):
            if isinstance(x, list) and len(x) == L:
                out[i] = x
        return out


class Run:
    """A run directory written by ``remoe train``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"run={str(self.path)!r} is not a directory")
        if not any((self.path / f).exists() for f in ("metrics.jsonl", METRICS_GZ, RUN_ARCHIVE,
                                                        "config.yaml", "final", "checkpoints",
                                                        "routing", ROUTING_ARCHIVE)):
            raise ConfigError(f"run={str(self.path)!r} holds no run (expected metrics.jsonl, "
                              "config.yaml, final/, checkpoints/ or routing/)")

    @property
    def name(self) -> str:
        cfg = self.config.get("run", {}) if isinstance(self.config, dict) else {}
        return str(cfg.get("name") or self.path.resolve().name)

    @cached_property
    def metrics(self) -> Metrics:
        return Metrics(run_jsonl(self.path, "metrics.jsonl"))

    @cached_property
    def evals(self) -> list[dict[str, Any]]:
        return last_per_step(run_jsonl(self.path, "eval.jsonl"))

    @cached_property
    def config(self) -> dict[str, Any]:
        data = run_bytes(self.path, "config.yaml")
        if data is None:
            return {}
        try:
            cfg = yaml.safe_load(data) or {}
        except yaml.YAMLError:
            return {}
        return cfg if isinstance(cfg, dict) else {}

    @cached_property
    def summary(self) -> dict[str, Any]:
        s = run_json(self.path, "summary.json")
        return s if isinstance(s, dict) else {}

    @cached_property
    def eval_results(self) -> dict[str, Any] | None:
        """``eval_results.json`` (``remoe eval --out``), or None."""
        return run_json(self.path, "eval_results.json")

    @cached_property
    def model_config(self):
        """The run's :class:`ReMoEConfig`: from a saved ``config.json`` (final/ or the latest
        checkpoint), else rebuilt from ``config.yaml``'s model section; None if neither."""
        from remoe.model.config import ReMoEConfig
        from remoe.rundir.loading import resolve_model_dir

        try:
            return ReMoEConfig.from_pretrained(resolve_model_dir(self.path))
        except (ConfigError, OSError, ValueError):
            pass
        fields = dict(self.config.get("model") or {})
        if not fields:
            return None
        try:
            return ReMoEConfig(**fields)  # a preset key is expanded by the model spec
        except (ConfigError, TypeError):
            return None

    @property
    def target_sparsity(self) -> float | None:
        """1 - k/E (None for a dense model or when the config is unknown)."""
        t = self.summary.get("target_sparsity")
        if isinstance(t, (int, float)):
            return float(t)
        cfg = self.model_config
        if cfg is None or not cfg.is_moe:
            return None
        return float(cfg.routing.target_sparsity)

    @property
    def router(self) -> str:
        cfg = self.model_config
        return str(cfg.routing.router) if cfg is not None else str(self.summary.get("router",
                                                                                    "?"))

    def seq_len(self, default: int = 256) -> int:
        return int((self.config.get("train") or {}).get("seq_len") or default)

    def mask_files(self) -> list[tuple[int, "MaskFile"]]:
        """``(step, MaskFile)`` of every recorded routing mask, by step: the loose
        ``routing/masks_<step>.npz`` files of a run directory, or the members of its
        committed study copy's ``run.zip`` (older copies: ``routing.zip``)."""
        out = []
        d = self.path / "routing"
        if d.is_dir():
            for p in d.iterdir():
                m = MASK_FILE.match(p.name)
                if m:
                    out.append((int(m.group(1)), MaskFile(p)))
        for packed in (self.path / RUN_ARCHIVE, self.path / ROUTING_ARCHIVE):
            if out or not packed.is_file():
                continue
            with zipfile.ZipFile(packed) as z:
                for info in z.infolist():
                    m = MASK_FILE.match(Path(info.filename).name)
                    if m:
                        out.append((int(m.group(1)), MaskFile(packed, info.filename,
                                                              info.file_size)))
        return sorted(out, key=lambda sm: sm[0])

    def last_masks(self, upto: int | None = None) -> tuple[int, np.ndarray] | None:
        """``(step, masks bool [L, T, N])`` of the last recorded routing mask (at or before
        step ``upto`` when given); None without one, or when it cannot be read or holds no
        token."""
        files = [f for f in self.mask_files() if upto is None or f[0] <= upto]
        if not files:
            return None
        step, source = files[-1]
        try:
            masks_LTN = load_masks(source)[0]
        except (OSError, ValueError, KeyError):
            return None
        return (step, masks_LTN) if masks_LTN.shape[1] > 0 else None


def as_run(run: "Run | str | Path") -> "Run":
    """``run`` itself, or the :class:`Run` of a run directory: what a study table reads, opened
    once per table build and handed to each of its sections (each reads the metrics once)."""
    return run if isinstance(run, Run) else Run(run)


@dataclass(frozen=True)
class MaskFile:
    """One recorded ``masks_<step>.npz``: a file, or a ``member`` of a ``run.zip``."""

    path: Path
    member: str | None = None
    member_size: int = 0

    @property
    def size(self) -> int:
        return self.member_size if self.member else self.path.stat().st_size

    @property
    def name(self) -> str:
        """The ``masks_<step>.npz`` name, inside a zip or not."""
        return Path(self.member).name if self.member else self.path.name

    def read(self) -> bytes:
        if self.member is None:
            return self.path.read_bytes()
        with zipfile.ZipFile(self.path) as z:
            return z.read(self.member)


def load_masks(source: "MaskFile | Path") -> tuple[np.ndarray, np.ndarray, int]:
    """One ``masks_<step>.npz`` (a path or a :class:`MaskFile`): ``(masks bool [L, T, N],
    token_ids [T], step)``."""
    data = source.read() if isinstance(source, MaskFile) else Path(source).read_bytes()
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        L, T, N = (int(v) for v in z["shape"])
        masks = np.unpackbits(z["masks"], axis=-1, count=N).astype(bool).reshape(L, T, N)
        token_ids = np.asarray(z["token_ids"]).reshape(-1)
        step = int(z["step"]) if "step" in z.files else -1
    return masks, token_ids, step
