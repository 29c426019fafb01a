"""Checkpoints: verified atomic writes, keep-last-N, resume selection, the checks of a changed
config, the run's own tokenizer, and the RNG states (so that ``--resume`` continues bit-exactly).

A checkpoint directory is a complete Hugging Face repository (``model.safetensors``,
``config.json`` with ``auto_map`` and the bundled model code, tokenizer files, generation config,
model card; see :func:`write_model_dir`) plus ``trainer_state.pt`` (optimizer, scheduler, lambda
controller, RNG states, data position) and ``checksums.json`` (size and sha256 of every file,
written last). It is written into a temporary sibling directory and renamed into place, then
``LATEST`` is replaced atomically: an interrupted write never leaves a half checkpoint under a
checkpoint's name, and ``--resume`` takes the newest checkpoint whose files verify
(:func:`find_resume_checkpoint`). The run-directory mechanics live in :mod:`remoe.rundir`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from remoe import rundir
from remoe.errors import ConfigError

LATEST = rundir.LATEST
STATE_FILE = rundir.STATE_FILE
atomic_write_text = rundir.atomic_write_text
# model fields that change how the model is computed, not what it is: a resume may change them
RUNTIME_MODEL_FIELDS = ("expert_backend", "recompute_experts")


def write_model_dir(final: Path, model, tokenizer_path: str | os.PathLike | None,
                    state: dict[str, Any] | None = None) -> Path:
    """Write a complete HF model directory (+ trainer state, + checksums.json) atomically to
    ``final``; a failure (a full disk included) leaves nothing half-written.

    The directory is a shareable Hugging Face repository: weights, ``config.json`` with
    ``auto_map`` and the model's code (:mod:`remoe.model.bundle`), the tokenizer files
    (``AutoTokenizer``, pad = eos, left padding), ``generation_config.json`` and a model card
    ``README.md`` with the run's numbers at this step (:mod:`remoe.rundir.card`)."""
    from remoe.data.tokenizer import write_hf_tokenizer_files
    from remoe.rundir.card import find_run_dir, write_card

    tmp = rundir.temp_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    with rundir.writing(final, cleanup=tmp):
        m = unwrap(model)
        from remoe.rundir.bars import no_hf_bars

        with no_hf_bars():  # remoe's progress only
            m.save_pretrained(tmp, safe_serialization=True)
        if tokenizer_path:
            write_hf_tokenizer_files(tokenizer_path, tmp, m.config.backbone.max_position_embeddings)
        write_card(tmp, m, find_run_dir(final), step=(state or {}).get("step"))
        if state is not None:  # marked: a checkpoint of this run without a manifest is damaged
            torch.save({**state, rundir.MANIFEST_KEY: True}, tmp / STATE_FILE)
        rundir.write_manifest(tmp)
        rundir.replace_dir(tmp, final)
    return final


def save_checkpoint(ckpt_root: Path, step: int, model, state: dict[str, Any],
                    tokenizer_path: str | None, keep_last: int,
                    keep_optimizer: str = "all") -> Path:
    """Write ``ckpt_root/step_<step>`` atomically, point LATEST at it, prune old ones; with
    ``keep_optimizer="newest"`` the older checkpoints kept lose their optimizer state
    (:func:`drop_optimizer_state`)."""
    with rundir.writing(ckpt_root):
        ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:07d}"
    final = write_model_dir(ckpt_root / name, model, tokenizer_path, state)
    atomic_write_text(ckpt_root / LATEST, name)
    if keep_last > 0:
        for old in rundir.checkpoint_dirs(ckpt_root)[keep_last:]:
            rundir.remove_dir(old)
    if keep_optimizer == "newest":
        for old in rundir.checkpoint_dirs(ckpt_root)[1:]:
            drop_optimizer_state(old)
    return final


#: ``trainer_state.pt`` key of a checkpoint whose optimizer state was dropped
OPTIMIZER_DROPPED = "optimizer_dropped"


def drop_optimizer_state(ckpt: Path) -> None:
    """Rewrite an older checkpoint without its optimizer state (weights, lambda controller, RNG
    and data position stay): a sibling directory of hard links with the new trainer state and
    manifest replaces it, so a crash leaves either the old or the new checkpoint, both whole."""
    if not (ckpt / STATE_FILE).is_file() or (ckpt / "dcp").is_dir():
        return
    try:
        state = rundir.load_state(ckpt)
    except Exception:  # noqa: BLE001 - a damaged checkpoint is left to --resume's checks
        return
    if state.get("optimizer") is None:
        return
    tmp = rundir.temp_path(ckpt)
    if tmp.exists():
        shutil.rmtree(tmp)
    with rundir.writing(ckpt, cleanup=tmp):
        for src in ckpt.rglob("*"):
            dst = tmp / src.relative_to(ckpt)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif src.name not in (STATE_FILE, rundir.MANIFEST):
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)
        torch.save({**state, "optimizer": None, OPTIMIZER_DROPPED: True}, tmp / STATE_FILE)
        rundir.write_manifest(tmp)
        rundir.replace_dir(tmp, ckpt)


def require_optimizer_state(ckpt: Path, state: dict[str, Any]) -> None:
    """One line instead of a resume that could not be bit-exact: ``ckpt`` kept no optimizer
    state (``train.keep_optimizer=newest`` dropped it when a newer checkpoint was written)."""
    if state.get("optimizer") is None and state.get(OPTIMIZER_DROPPED):
        raise ConfigError(
            f"--resume: {ckpt.name} holds no optimizer state (train.keep_optimizer=newest keeps "
            "it in the newest checkpoint only, and that one is missing or damaged); continue "
            f"from its weights with --set train.init_from={ckpt} in a new run")


def find_resume_checkpoint(ckpt_root: Path, report: bool = True
                           ) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest checkpoint that verifies and its trainer state, or ``(None, None)``.

    With ``report`` (the writing process): says which newer checkpoints were skipped and why,
    renames them to ``damaged-step_*`` and points LATEST at the chosen one.
    """
    ckpt, state, skipped = rundir.find_resumable(ckpt_root, rundir.say if report else None)
    if report and ckpt is not None:
        for bad, _ in skipped:
            rundir.say(f"--resume: moved {bad.name} to checkpoints/{rundir.set_aside(bad).name}")
        if rundir.read_latest(ckpt_root) != (ckpt.name, None):
            atomic_write_text(ckpt_root / LATEST, ckpt.name)
    if ckpt is None and skipped:
        why = "; ".join(f"{p.name}: {r}" for p, r in skipped[:3])
        raise ConfigError(f"--resume: no checkpoint under {ckpt_root} verifies ({why}); start "
                          "over with --overwrite")
    return ckpt, state


# ----------------------------------------------------------------------------- config changes

def _model_fields(section: dict[str, Any]) -> dict[str, Any]:
    """A config's model section resolved by the model spec (defaults < preset < explicit
    fields); a section the spec cannot read is compared as written."""
    from remoe.model.spec import ModelSpec, defaults

    fields = dict(section or {})
    try:
        resolved = ModelSpec.from_flat(fields, strict=False).flat()
    except (ConfigError, TypeError, ValueError):
        resolved = {}
    spelled = {"preset", "moe_top_k"}  # resolved into the fields they stand for
    return {**defaults(), **resolved,
            **{k: v for k, v in fields.items() if k not in resolved and k not in spelled}}


def _flat(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in (d or {}).items()}


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's saved config.yaml as a dict (None when missing or unreadable)."""
    try:
        old = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return old if isinstance(old, dict) else None


def config_changes(old: dict[str, Any], new: dict[str, Any]
                   ) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """``(refused, warned)`` differences ``(field, new, old)`` between two config dicts: any
    model field but the runtime ones is refused (defaults filled in on both sides);
    train/data/analysis fields and run.seed present in both warn."""
    a, b = _model_fields(old.get("model")), _model_fields(new.get("model"))
    refused, warned = [], []
    # fields a config names come first: a changed hidden_size also changes the default
    # ffn_hidden_size, and the one line should name the field the user changed
    named = set(old.get("model") or {}) | set(new.get("model") or {})
    for k in sorted(set(a) | set(b), key=lambda k: (k not in named, k)):
        if a.get(k) != b.get(k):
            (warned if k in RUNTIME_MODEL_FIELDS else refused).append((f"model.{k}", b.get(k),
                                                                       a.get(k)))
    flat_old, flat_new = {}, {}
    for section in ("train", "data", "analysis"):
        flat_old.update(_flat(old.get(section) or {}, f"{section}."))
        flat_new.update(_flat(new.get(section) or {}, f"{section}."))
    flat_old["run.seed"] = (old.get("run") or {}).get("seed")
    flat_new["run.seed"] = (new.get("run") or {}).get("seed")
    for k in sorted(set(flat_old) & set(flat_new)):  # a field one side lacks: not comparable
        if flat_old[k] != flat_new[k]:
            warned.append((k, flat_new[k], flat_old[k]))
    return refused, warned


def check_resume_model(run_dir: Path, new: dict[str, Any]) -> None:
    """Refuse (one line naming the field) a resume that changes the model."""
    old = read_run_config(run_dir)
    if old is None:  # compare with the newest checkpoint's config.json (the model it holds)
        ckpts = [c for c in rundir.checkpoint_dirs(run_dir / "checkpoints")
                 if (c / "config.json").is_file()]
        if ckpts:
            check_model_against_checkpoint(ckpts[0], new.get("model") or {})
        return
    refused, _ = config_changes(old, new)
    if refused:
        k, v, was = refused[0]
        more = f" (and {len(refused) - 1} more model field(s))" if len(refused) > 1 else ""
        raise ConfigError(f"--resume: {k}={v} differs from the run's {was}{more}; start a new "
                          "run or use --overwrite")


def check_model_against_checkpoint(ckpt: Path, model: Any) -> None:
    """Refuse (one line naming the field) a model that differs from the one the checkpoint's
    ``config.json`` records (runtime fields excepted). ``model``: the ReMoEConfig about to be
    trained, or a config's ``model`` section (its vocabulary, when it sets none, is the
    checkpoint's: the tokenizer decides it)."""
    from remoe.model.config import ReMoEConfig
    from remoe.model.spec import ModelSpec

    try:
        saved = ReMoEConfig.from_pretrained(ckpt).spec.flat()
    except Exception as e:  # noqa: BLE001 - any unreadable config.json
        raise ConfigError(f"--resume: the run's config.yaml is missing and {ckpt.name}/config.json"
                          f" is unreadable ({type(e).__name__}); nothing to check the model "
                          "against: start a new run or use --overwrite") from None
    explicit = set(model) if isinstance(model, dict) else set()  # named first when they differ
    if isinstance(model, dict):
        from remoe.model.config import PRESETS

        fields = dict(model)
        preset = fields.pop("preset", None)
        fields = {**(PRESETS.get(preset, {}) if preset else {}), **fields}
        if "vocab_size" not in model:  # a preset's is replaced by the tokenizer's (the trainer)
            fields["vocab_size"] = saved.get("vocab_size")
        new = ModelSpec.from_flat(fields).flat()
    else:
        new = model.spec.flat()
    refused = [(k, new.get(k), saved.get(k))
               for k in sorted(set(saved) | set(new), key=lambda k: (k not in explicit, k))
               if k not in RUNTIME_MODEL_FIELDS and new.get(k) != saved.get(k)]
    if refused:
        k, v, was = refused[0]
        more = f" (and {len(refused) - 1} more model field(s))" if len(refused) > 1 else ""
        raise ConfigError(f"--resume: model.{k}={v} differs from the checkpoint's {was} "
                          f"({ckpt.name}/config.json; the run's config.yaml is missing){more}; "
                          "start a new run or use --overwrite")


def check_resume_config(run_dir: Path, new: dict[str, Any], new_yaml: str, step: int,
                        ckpt: Path | None = None, model_cfg=None) -> None:
    """Before a resume from ``step``: refuse model changes, warn (one line per field) about the
    others and keep the run's old config.yaml as ``config.yaml.prev-<step>`` when it changes.
    Without a readable config.yaml the model is compared with ``ckpt``'s config.json
    (``model_cfg``: the model about to be trained)."""
    path = run_dir / "config.yaml"
    old = read_run_config(run_dir)
    if old is None:
        if ckpt is not None and model_cfg is not None:
            check_model_against_checkpoint(ckpt, model_cfg)
        rundir.warn(f"--resume: {path} is missing or unreadable; the model was checked against "
                    "the checkpoint's config.json, the other fields cannot be compared"
                    if ckpt is not None and model_cfg is not None else
                    f"--resume: {path} is missing or unreadable; nothing to compare the config "
                    "with")
        return
    check_resume_model(run_dir, new)
    _, warned = config_changes(old, new)
    for k, v, was in warned:
        rundir.warn(f"--resume: {k}={v} differs from the run's {was} (continuing with {v})")
    old_text = path.read_text(encoding="utf-8")
    if old_text != new_yaml:
        keep = path.with_name(f"config.yaml.prev-{step}")
        n = 1
        while keep.exists() and keep.read_text(encoding="utf-8") != old_text:
            n += 1
            keep = path.with_name(f"config.yaml.prev-{step}-{n}")
        atomic_write_text(keep, old_text)
        rundir.say(f"--resume: the run's previous config.yaml is kept as {keep.name}")


# ----------------------------------------------------------------------------- tokenizer

RUN_TOKENIZER = "tokenizer.json"  # <run>/tokenizer.json: the tokenizer the run trains with


def keep_run_tokenizer(run_dir: Path, data: Any, resume: bool) -> Path | None:
    """The run's own copy of the tokenizer it trains with (``<run>/tokenizer.json``), which
    every checkpoint and ``final/`` get: never the data cache's file, which could be rebuilt
    under the run. A fresh run copies the cache's file (checked against the sha256 the data
    was loaded with); a resume refuses (one line) data whose tokenizer differs from the run's."""
    import hashlib

    src = getattr(data, "tokenizer_path", None)
    manifest = getattr(data, "manifest", None) or {}
    want = (manifest.get("tokenizer") or {}).get("sha256")
    if src is None or want is None:
        return Path(src) if src is not None else None
    cache_bytes = Path(src).read_bytes()
    if hashlib.sha256(cache_bytes).hexdigest() != want:
        raise ConfigError(f"the data cache's {src} changed after it was loaded (another "
                          "process rebuilt the cache); start the run again")
    path = run_dir / RUN_TOKENIZER
    if resume and path.is_file():
        if hashlib.sha256(path.read_bytes()).hexdigest() != want:
            raise ConfigError(
                f"--resume: the data cache's tokenizer (vocab {getattr(data, 'vocab_size', '?')},"
                f" {src}) is not the one this run trained with ({path}): the cache was rebuilt "
                "with other data settings; resume with the run's data settings and a cache "
                "built with them (data.cache_dir)")
        return path
    atomic_write_text(path, cache_bytes.decode("utf-8"))
    return path


# ----------------------------------------------------------------------------- helpers

def unwrap(model):
    """The ReMoEForCausalLM inside a DDP wrapper."""
    return getattr(model, "module", model)


# ----------------------------------------------------------------------------- RNG states

def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def to_weights_only(obj: Any) -> Any:
    """Make python/numpy RNG states loadable with ``torch.load(weights_only=True)``."""
    if isinstance(obj, tuple):
        return [to_weights_only(o) for o in obj]
    if isinstance(obj, list):
        return [to_weights_only(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_weights_only(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), int(np_state[2]),
                         int(np_state[3]), float(np_state[4])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
