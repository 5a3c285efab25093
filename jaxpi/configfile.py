"""Frozen config dataclasses from YAML files and `key.sub=value` command-line overrides.

    load_config(SFTConfig, "configs/sft/tiny.yaml", ["optim.lr=3e-4", "train.steps=20"])

A YAML file only sets fields: every key must name a field of the dataclass (nested dataclasses are
nested mappings), and an unknown key is an error that lists the valid ones. Overrides are applied
after the file, each `dotted.key=value` with `value` parsed as YAML and converted to the field's
annotated type (`int`, `float`, `bool`, `str`, `X | None`, `tuple[X, ...]`, nested dataclasses),
so `optim.lr=1e-4` is a float even though YAML 1.1 reads `1e-4` as a string. Validation of
values is left to each dataclass's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a value of the wrong type."""


def field_names(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of a dataclass, depth first (`["model.base", "model.dtype", ...]`)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = _dataclass_type(hints[f.name])
        out += field_names(sub, key + ".") if sub is not None else [key]
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """`cls` built from a YAML file (optional) and then `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no config file {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config sections")
        data = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        set_dotted(data, cls, key.strip(), value)
    where = str(path) if path is not None else "config"
    return from_dict(cls, data, where=where)


def set_dotted(data: dict[str, Any], cls: type, key: str, raw: str) -> None:
    """Set `data[a][b] = value` for `key` "a.b", checking the key against `cls` first and keeping
    `raw` verbatim for `str` fields (so `output.dir=001` stays "001")."""
    parts = key.split(".")
    hint = _resolve(cls, parts, key)
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {}
        node = child
    # YAML parsing gives lists, null and numbers their types; a str field keeps the text verbatim.
    node[parts[-1]] = raw if _base_type(hint) is str else yaml.safe_load(raw) if raw.strip() else None


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "config", prefix: str = "") -> T:
    """Build `cls` from a (nested) mapping, converting each value to its field's type."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'config'} must be a mapping, not {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(f"{where}: {_unknown_message(field_names(cls, prefix), key)}")
    kwargs = {}
    for name, value in data.items():
        hint, key = hints[name], prefix + name
        sub = _dataclass_type(hint)
        if sub is not None:
            kwargs[name] = from_dict(sub, value or {}, where=where, prefix=key + ".")
        else:
            kwargs[name] = convert(value, hint, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain YAML/JSON data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(x) for x in obj]
    return obj


def convert(value: Any, hint: Any, key: str) -> Any:
    """`value` as an instance of the annotation `hint`, or a `ConfigError` naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot convert {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads `1e-4` (no dot) as a string
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ConfigError(f"{key}: cannot convert {value!r} to {hint}")


# ---- helpers ---------------------------------------------------------------------------------------
def _dataclass_type(hint: Any) -> type | None:
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _base_type(hint: Any) -> Any:
    """`str` for `str` and `str | None`; the hint itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _resolve(cls: type, parts: list[str], key: str) -> Any:
    """The annotation of the dotted key's field, or a `ConfigError` listing the valid keys."""
    node: Any = cls
    for i, p in enumerate(parts):
        sub = _dataclass_type(node)
        if sub is None:
            raise ConfigError(f"{'.'.join(parts[:i])} is a value, not a section; cannot set {key!r}")
        hints = typing.get_type_hints(sub)
        if p not in hints or p not in {f.name for f in dataclasses.fields(sub)}:
            prefix = ".".join(parts[:i]) + "." if i else ""
            raise ConfigError(_unknown_message(field_names(sub, prefix), key))
        node = hints[p]
    if _dataclass_type(node) is not None:
        raise ConfigError(
            f"{key!r} is a section; set one of its keys: {', '.join(field_names(node, key + '.'))}"
        )
    return node


def _unknown_message(valid: list[str], key: str) -> str:
    """The error for an unknown key: the closest valid key, then every key of its section."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}"
