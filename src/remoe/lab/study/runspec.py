"""One expanded run of a study: its name, label, group, seed, overrides, config and the runs
it depends on (what :mod:`remoe.lab.study.spec` expands a spec into)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def fmt_value(v: Any) -> str:
    """An override's value as a label or a command line shows it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


@dataclass
class RunSpec:
    """One expanded run: ``config`` is the full experiment (sections dict) without its stop
    rule applied; :func:`remoe.lab.study.runconfig.apply_stop` adds it."""

    name: str
    label: str
    group: str
    seed: int
    overrides: dict[str, Any]  # the spec's overrides of this run (group set + grid + run set)
    config: dict[str, dict[str, Any]]
    stop: dict[str, float] | None = None
    match_of: tuple[str, ...] = ()  # the runs whose FLOPs (summed) this one matches
    init_of: str | None = None  # the run whose weights this one starts from

    @property
    def deps(self) -> tuple[str, ...]:
        """The runs that must have trained before this one starts."""
        return self.match_of + ((self.init_of,) if self.init_of else ())

    def describe_overrides(self, skip: tuple[str, ...] = ()) -> str:
        return " ".join(f"{k}={fmt_value(v)}" for k, v in self.overrides.items() if k not in skip)

    def describe_stop(self) -> str:
        if self.match_of:
            return f"flops of {' + '.join(self.match_of)}"
        if self.stop:
            (k, v), = self.stop.items()
            return f"{k} {v:.3g}" if k == "flops" else f"{k} {int(v)}"
        return f"steps {self.config['train'].get('max_steps', 'default')}"
