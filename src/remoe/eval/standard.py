"""The paper's zero-shot tasks (Table 2), run through lm-eval only when their data is local.

Each task is lm-eval's own definition (its YAML: prompt, choices, metrics); only where the data
comes from changes. The dataset is looked up, without any network access, in this order:

1. ``--task-data-dir DIR``:
   * ``DIR/<task>/`` -- a ``DatasetDict.save_to_disk`` directory, or data files named by
     split (``test.jsonl``, ``validation.parquet``, ...; ``.jsonl``/``.json``/``.parquet``/
     ``.csv``);
   * ``DIR/<dataset path>/`` -- a copy of the dataset's Hugging Face repository (e.g.
     ``DIR/allenai/ai2_arc`` from ``huggingface-cli download --repo-type dataset``);
2. the Hugging Face datasets cache (``HF_DATASETS_CACHE`` / ``HF_HOME``), in offline mode.

A task whose data is in none of them is skipped with a message naming the dataset and the two
ways to provide it (:func:`missing_data_message`); the other tasks still run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remoe.eval.offline import force_offline

log = logging.getLogger("remoe.eval")

#: Table 2 of the paper: (column, lm-eval task, metric reported).
PAPER_TASKS: tuple[tuple[str, str, str], ...] = (
    ("ARC-c", "arc_challenge", "acc"),
    ("ARC-e", "arc_easy", "acc"),
    ("BoolQ", "boolq", "acc"),
    ("HellaSwag", "hellaswag", "acc"),
    ("LAMBADA", "lambada_openai", "acc"),
    ("PIQA", "piqa", "acc"),
    ("RACE", "race", "acc"),
)
PAPER_TASK_NAMES = tuple(t for _, t, _ in PAPER_TASKS)

# where lm-eval 0.4.x keeps these tasks (saves indexing all ~15k of its tasks)
_LM_EVAL_YAML = {
    "arc_challenge": "arc/arc_challenge.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "piqa": "piqa/piqa.yaml",
    "race": "race/race.yaml",
}
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class TaskDataMissing(Exception):
    """The task's dataset is not available locally (the message says how to provide it)."""


@dataclass
class StandardTask:
    """A standard task ready to run (``config``) or skipped (``missing`` says why)."""

    name: str
    column: str
    metric: str
    config: dict[str, Any] | None = None
    missing: str | None = None
    source: str | None = None  # where its data was found


def column_and_metric(name: str) -> tuple[str, str]:
    for col, task, metric in PAPER_TASKS:
        if task == name:
            return col, metric
    return name, "acc"


def lm_eval_task_config(name: str) -> dict[str, Any]:
    """lm-eval's configuration of task ``name`` (includes and ``!function`` resolved)."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    root = Path(lm_eval.tasks.__file__).parent
    rel = _LM_EVAL_YAML.get(name)
    path = root / rel if rel else None
    if path is None or not path.is_file():
        from lm_eval.tasks import TaskManager

        entry = TaskManager().task_index.get(name)
        if entry is None or entry.yaml_path is None:
            raise KeyError(f"{name!r} is not an lm-eval task defined by a YAML file")
        path = Path(entry.yaml_path)
    cfg = load_yaml(path, resolve_func=True)
    if cfg.get("task") != name:
        raise KeyError(f"{path} defines task {cfg.get('task')!r}, not {name!r}")
    return cfg


def eval_split(cfg: dict[str, Any]) -> str:
    """The split lm-eval evaluates on: test if the task has one, else validation."""
    split = cfg.get("test_split") or cfg.get("validation_split")
    if not split:
        raise KeyError(f"task {cfg.get('task')!r} has neither a test nor a validation split")
    return split


def _dataset_label(cfg: dict[str, Any]) -> str:
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    return f"{path} (config {name})" if name else str(path)


def missing_data_message(task: str, cfg: dict[str, Any], task_data_dir: str | Path | None,
                         reason: str = "") -> str:
    """Which data ``task`` needs, that it is skipped, and how to provide it offline."""
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    args = f"{path!r}" + (f", {name!r}" if name else "")
    looked = (f"--task-data-dir {task_data_dir} ({task}/, {path}/) and " if task_data_dir
              else "") + "the Hugging Face datasets cache"
    return (
        f"task {task}: dataset {_dataset_label(cfg)} is not available offline "
        f"({reason or 'looked in ' + looked}) -- skipped. To provide it, on a machine with "
        f"network access run\n"
        f"    python -c \"import datasets; datasets.load_dataset({args})"
        f".save_to_disk('DIR/{task}')\"\n"
        f"  then copy DIR here and pass --task-data-dir DIR (or copy that machine's datasets "
        f"cache and set HF_DATASETS_CACHE to it; see docs/EVAL.md).")


def _load_local_dir(d: Path, name: str | None):
    import datasets

    if (d / "dataset_dict.json").is_file() or (d / "state.json").is_file():
        ds = datasets.load_from_disk(str(d))
        return ds if isinstance(ds, datasets.DatasetDict) else datasets.DatasetDict({"test": ds})
    files: dict[str, dict[str, str]] = {}
    for f in sorted(d.iterdir()):
        builder = _FILE_BUILDERS.get(f.suffix)
        if builder and f.is_file():
            files.setdefault(builder, {})[f.stem] = str(f)
    if len(files) == 1:
        (builder, data_files), = files.items()
        return datasets.load_dataset(builder, data_files=data_files)
    # a copy of the dataset's hub repository: let datasets read its layout / README configs
    return datasets.load_dataset(str(d), name)


def load_task_dataset(task: str, cfg: dict[str, Any],
                      task_data_dir: str | Path | None = None) -> tuple[Any, str]:
    """``(DatasetDict, where it came from)`` for ``task``; raises :class:`TaskDataMissing`.

    Never downloads: the Hugging Face libraries are put in offline mode first.
    """
    force_offline()
    import datasets

    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    split = eval_split(cfg)
    tried = []
    if task_data_dir is not None:
        base = Path(task_data_dir)
        for d in (base / task, base / str(path)):
            if d.is_dir():
                tried.append(d)
                try:
                    ds = _load_local_dir(d, name)
                except Exception as e:  # noqa: BLE001 - report and fall through
                    raise TaskDataMissing(missing_data_message(
                        task, cfg, task_data_dir, f"{d} could not be read: {e}")) from None
                if split not in ds:
                    raise TaskDataMissing(missing_data_message(
                        task, cfg, task_data_dir, f"{d} has splits {sorted(ds)}, not {split!r}"))
                return ds, str(d)
    try:
        ds = datasets.load_dataset(path, name)
    except Exception as e:  # noqa: BLE001 - offline miss: ConnectionError, FileNotFoundError, ...
        log.debug("offline load of %s failed: %s", _dataset_label(cfg), e)
        raise TaskDataMissing(missing_data_message(task, cfg, task_data_dir)) from None
    if split not in ds:
        raise TaskDataMissing(missing_data_message(
            task, cfg, task_data_dir, f"the cached copy has splits {sorted(ds)}, not {split!r}"))
    return ds, "Hugging Face datasets cache"


def resolve_standard_tasks(names: list[str],
                           task_data_dir: str | Path | None = None) -> list[StandardTask]:
    """Each task's lm-eval config with its local data attached, or why it is skipped."""
    out = []
    for name in names:
        column, metric = column_and_metric(name)
        st = StandardTask(name, column, metric)
        try:
            cfg = lm_eval_task_config(name)
        except KeyError as e:
            st.missing = f"task {name}: {e.args[0]} -- skipped"
            out.append(st)
            continue
        try:
            ds, st.source = load_task_dataset(name, cfg, task_data_dir)
        except TaskDataMissing as e:
            st.missing = str(e)
            out.append(st)
            continue
        cfg = dict(cfg)
        cfg.pop("tag", None)
        cfg.pop("group", None)
        # lm-eval reads the train split for few-shot examples even at zero shots: drop the
        # splits the local copy lacks (the evaluated one is there, load_task_dataset checked)
        for key in ("training_split", "validation_split", "fewshot_split"):
            if cfg.get(key) and cfg[key] not in ds:
                cfg[key] = None
        cfg["custom_dataset"] = _Preloaded(ds)
        st.config = cfg
        out.append(st)
    return out


class _Preloaded:
    """lm-eval's ``custom_dataset`` hook: hands over the dataset loaded above."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __call__(self, **_: Any) -> Any:
        return self.ds

    def __deepcopy__(self, memo: dict) -> "_Preloaded":  # lm-eval deep-copies task configs
        return self

    def __repr__(self) -> str:
        return "remoe.eval.standard._Preloaded"
