"""Reading YAML configs safely: only plain YAML values (PyYAML's SafeLoader, so no tag can
construct an object or run code), every key unique, and a bound on the values a file may
expand to through aliases (an "alias bomb" of a few hundred bytes would otherwise hang
anything that walks it). Problems are one :class:`~remoe.errors.ConfigError` line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from remoe.errors import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but a mapping with a repeated key is an error (YAML requires unique
    keys; PyYAML would silently keep the last value)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges may override
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first_line.get(key)
                except TypeError:  # unhashable: the base class reports it
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} at line {line} (first at line "
                        f"{seen}); YAML keys must be unique", None)
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


#: values a config may hold once YAML aliases are expanded (a real one has a few hundred)
MAX_CONFIG_VALUES = 100_000


def check_size(obj: Any) -> None:
    """Refuse a YAML value that expands to more than MAX_CONFIG_VALUES values: a few hundred
    bytes of nested aliases (an "alias bomb") expand to billions, and anything that walks them
    (validation, repr, saving config.yaml) would never finish. Stops at the limit."""
    count, stack = 0, [obj]
    while stack:
        v = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(f"the config holds more than {MAX_CONFIG_VALUES:,} values once "
                              "its YAML aliases (&name / *name) are expanded; write the values "
                              "out instead")
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def load_text(text: str) -> Any:
    """YAML text -> value: safe tags only, unique keys, bounded size (ConfigError / YAMLError)."""
    value = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    check_size(value)
    return value


def problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line: the problem and where."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{e.problem}{where}"
    return " ".join(str(e).split())


def read_file(p: Path) -> Any:
    """A YAML config file's value; every problem is one ConfigError naming ``config=PATH``."""
    if not p.is_file():
        raise ConfigError(f"config={str(p)!r} does not exist" if not p.exists() else
                          f"config={str(p)!r} is not a file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"config={str(p)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"line {line}, offset {e.start}): save it as UTF-8") from None
    try:
        return load_text(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config={str(p)!r} is not valid YAML: {problem(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"config={str(p)!r}: {e}") from None
