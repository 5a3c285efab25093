"""Frozen config dataclasses from YAML files and `key.sub=value` command-line overrides.

    load_config(SFTConfig, "configs/sft/tiny.yaml", ["optim.lr=3e-4", "train.steps=20"])

A YAML file only sets fields: every key must name a field of the dataclass (nested dataclasses are
nested mappings), and an unknown key is an error that lists the valid ones. Overrides are applied
after the file, each `dotted.key=value` with `value` parsed as YAML and converted to the field's
annotated type (`int`, `float`, `bool`, `str`, `X | None`, `tuple[X, ...]`, nested dataclasses),
so `optim.lr=1e-4` is a float even though YAML 1.1 reads `1e-4` as a string. Validation of
values is left to each dataclass's `__post_init__`.

Layers, each over the one before: the dataclass's defaults, a command's own `defaults`, the file,
typed `values` (the flags a user passed), then the overrides. `jaxpi.configfile.help` lists every
key with its type, default and comment for a command's --help.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a value of the wrong type."""


def key_name(field: str) -> str:
    """A field's key in files and overrides: its name, but for a Python keyword, which a field
    spells with a trailing underscore (PEP 8: `async_`), the keyword itself (`train.async`)."""
    return field[:-1] if field.endswith("_") and keyword.iskeyword(field[:-1]) else field


def _keys(cls: type) -> dict[str, str]:
    """key -> field name of a dataclass's fields."""
    return {key_name(f.name): f.name for f in dataclasses.fields(cls)}


def field_names(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of a dataclass, depth first (`["model.base", "model.dtype", ...]`)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{key_name(f.name)}"
        sub = _dataclass_type(hints[f.name])
        out += field_names(sub, key + ".") if sub is not None else [key]
    return out


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
) -> T:
    """`cls` built from `defaults` (dotted key -> value, over the dataclass's own), a YAML file
    (optional), typed `values` (dotted key -> value) and then `key.sub=value` overrides."""
    data = config_data(cls, path, overrides, defaults=defaults, values=values)
    return from_dict(cls, data, where=str(path) if path is not None else "config")


def config_data(
    cls: type,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The nested mapping `load_config` builds `cls` from, every key checked against `cls`."""
    data: dict[str, Any] = {}
    for key, value in (defaults or {}).items():
        set_value(data, cls, key, value)
    if path is not None:
        _merge(data, read_file(path))
    for key, value in (values or {}).items():
        set_value(data, cls, key, value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        set_dotted(data, cls, key.strip(), value)
    return data


def read_file(path: str | Path) -> dict[str, Any]:
    """A YAML (or JSON) config file as a mapping of its top-level keys."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no config file {path}")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error(path, e)) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    return loaded


def resolve_path(name: str | Path, directory: Path, what: str = "config") -> Path:
    """A config file named on the command line: `name` itself when it is a path (it has a `/` or
    ends in .yaml/.yml), else `directory/NAME.yaml`; a missing one lists the names there."""
    text = str(name)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(f"no config file {path}")
        return path
    path = directory / f"{text}.yaml"
    if not path.exists():
        known = ", ".join(preset_names(directory)) or "none"
        raise FileNotFoundError(f"no {what} {text!r} in {directory}; known: {known}")
    return path


def preset_names(directory: Path) -> list[str]:
    """The NAMEs of `directory/NAME.yaml`."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def set_dotted(data: dict[str, Any], cls: type, key: str, raw: str) -> None:
    """Set `data[a][b] = value` for `key` "a.b", checking the key against `cls` first and keeping
    `raw` verbatim for `str` fields (so `output.dir=001` stays "001")."""
    hint = _resolve(cls, key.split("."), key)
    # YAML parsing gives lists, null and numbers their types; a str field keeps the text verbatim.
    try:
        value = raw if _base_type(hint) is str else yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {key}={raw}: the value is not YAML: {problem}") from None
    _put(data, key, value)


def yaml_error(path: str | Path, e: yaml.YAMLError) -> str:
    """A YAML syntax error as `FILE:LINE: problem (column C; while ... at line L)`, 1-based."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return f"{path}: {problem}"
    where = [f"column {mark.column + 1}"]
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        where.append(context + (f" started at line {context_mark.line + 1}" if context_mark else ""))
    return f"{path}:{mark.line + 1}: {problem} ({'; '.join(where)})"


def set_value(data: dict[str, Any], cls: type, key: str, value: Any) -> None:
    """Set `data[a][b] = value` for `key` "a.b" (a value already typed, as a flag's), checking the
    key against `cls` first; `from_dict` converts it."""
    _resolve(cls, key.split("."), key)
    _put(data, key, value)


def required_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of `cls` that have no default."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and _required(f):
            sub, key = _dataclass_type(hints[f.name]), prefix + key_name(f.name)
            out += required_keys(sub, f"{key}.") if sub is not None else [key]
    return out


def has_key(data: Mapping[str, Any], key: str) -> bool:
    """Whether the nested mapping `data` holds dotted `key`."""
    node: Any = data
    for p in key.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return True


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "config", prefix: str = "") -> T:
    """Build `cls` from a (nested) mapping, converting each value to its field's type."""
    if not isinstance(data, Mapping):
        raise ConfigError(_at(where, f"{prefix.rstrip('.') or 'config'} must be a mapping, not {data!r}"))
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    keys = _keys(cls)
    unknown = sorted(set(data) - set(keys))
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(_at(where, _unknown_message(field_names(cls, prefix), key)))
    data = {keys[k]: v for k, v in data.items()}
    for f in fields:
        if f.init and f.name not in data and _required(f):
            if _dataclass_type(hints[f.name]) is None:
                raise ConfigError(_at(where, f"config key {prefix + key_name(f.name)!r} is required"))
            data[f.name] = {}  # a section without a default: its own keys' defaults
    kwargs = {}
    for name, value in data.items():
        hint, key = hints[name], prefix + key_name(name)
        sub = _dataclass_type(hint)
        if sub is not None:
            kwargs[name] = from_dict(sub, value or {}, where=where, prefix=key + ".")
        else:
            kwargs[name] = convert(value, hint, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(_at(where, str(e))) from e


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain YAML/JSON data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {key_name(f.name): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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
            if arg is str and not isinstance(value, str) and any(a not in (str, type(None)) for a in args):
                continue  # `int | str`: a number is the int, only text is the str
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


def parse_size(text: str | int) -> int:
    """A byte count: 5GB, 500MiB, 1000000 (binary units either way); an int is taken as is."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit]
    return int(float(m.group(1)) * scale)


# ---- helpers ---------------------------------------------------------------------------------------
def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _at(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {}
        node = child
    node[parts[-1]] = value


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    """`top` over `base`, section by section."""
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = dict(v) if isinstance(v, Mapping) else v


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
        hints, keys = typing.get_type_hints(sub), _keys(sub)
        if p not in keys:
            prefix = ".".join(parts[:i]) + "." if i else ""
            raise ConfigError(_unknown_message(field_names(sub, prefix), key))
        node = hints[keys[p]]
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
