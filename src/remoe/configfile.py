"""Which experiment file a command reads, and the ``--set`` slips named before it is read
(used by the ``remoe train`` and ``remoe data`` commands)."""

from __future__ import annotations

from pathlib import Path

from remoe.errors import ConfigError
from remoe.experiment import DEFAULT_CONFIG


def check_set_syntax(arg: str | None, overrides: list[str] | None) -> None:
    """``--set KEY VALUE`` (no ``=``): argparse took VALUE for the config file; name the slip
    (one line) before the missing file is reported."""
    for text in overrides or []:
        if "=" in text:
            continue
        value = arg if arg is not None and not Path(arg).exists() else "VALUE"
        raise ConfigError(f"--set {text} has no '=': did you mean --set {text.strip()}={value}?")


def config_path(arg: str | None, overrides: list[str] | None = None) -> Path | None:
    """The experiment file a command reads: ``arg`` (ConfigError if it does not exist, with the
    nearest match under ``configs/``, or the ``--set`` it looks like), else the default
    experiment :data:`DEFAULT_CONFIG` when running from a source checkout (None otherwise:
    the dataclass defaults, the same tiny ReMoE). ``overrides``: the command's ``--set``
    values, checked first (:func:`check_set_syntax`)."""
    check_set_syntax(arg, overrides)
    if arg is None:
        return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    path = Path(arg)
    if not path.exists():  # e.g. configs/dmoe.yaml: suggest configs/paper/dmoe.yaml
        cwd = Path.cwd()
        found = {q.resolve() for root in (Path("configs"), DEFAULT_CONFIG.parent)
                 if root.is_dir() for q in root.rglob(path.name)}
        near = sorted(str(q.relative_to(cwd)) if q.is_relative_to(cwd) else str(q)
                      for q in found)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        if not near and "=" in arg and "." in arg.split("=", 1)[0]:
            hint = f" (to change one field, use --set {arg})"
        raise ConfigError(f"config={arg!r} does not exist{hint}")
    return path
