"""Frozen config dataclasses from YAML files and `key.sub=value` command-line overrides.

    load_config(SFTConfig, "configs/sft/tiny.yaml", ["optim.lr=3e-4", "train.steps=20"])

A YAML file only sets fields: every key must name a field of the dataclass (nested dataclasses are
nested mappings), and an unknown key is an error that lists the valid ones. Overrides are applied
after the file, each `dotted.key=value` with `value` parsed as YAML and converted to the field's
annotated type (`int`, `float`, `bool`, `str`, `X | None`, `tuple[X, ...]`, nested dataclasses),
so `optim.lr=1e-4` is a float even though YAML 1.1 reads `1e-4` as a string. Validation of
values is left to each dataclass's `__post_init__`.

Layers, each over the one before: the dataclass's defaults, a command's own `defaults`, the file,
typed `values` (the flags a user passed), then the overrides. `help_section` lists every key with
its type, default and the `#` comment above or beside its field in the source (`add_config_help`
puts it at the end of a parser's --help).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Mapping, Sequence
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
    loaded = yaml.safe_load(path.read_text()) or {}
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
    value = raw if _base_type(hint) is str else yaml.safe_load(raw) if raw.strip() else None
    _put(data, key, value)


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
            sub = _dataclass_type(hints[f.name])
            out += required_keys(sub, f"{prefix}{f.name}.") if sub is not None else [prefix + f.name]
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
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(_at(where, _unknown_message(field_names(cls, prefix), key)))
    data = dict(data)
    for f in fields:
        if f.init and f.name not in data and _required(f):
            if _dataclass_type(hints[f.name]) is None:
                raise ConfigError(_at(where, f"config key {prefix + f.name!r} is required"))
            data[f.name] = {}  # a section without a default: its own keys' defaults
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
        raise ConfigError(_at(where, str(e))) from e


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


# ---- generated help ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One settable key of a config: what `help_section` prints about it."""

    key: str  # dotted, as in key.sub=value
    type: str  # the annotation as written ("int | None")
    default: Any  # dataclasses.MISSING when the key is required
    comment: str  # the `#` comment(s) above or beside the field; "" when it has none

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def describe(cls: type, defaults: Mapping[str, Any] | None = None) -> list[KeyDoc]:
    """Every key of `cls` (depth first, as `field_names`) with its type, default (a command's own
    `defaults` over the dataclass's) and comment."""
    out = []
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    values = _flat_defaults(cls)
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(hints[f.name])
        if sub is not None:
            nested = describe(sub)
            out += [
                dataclasses.replace(
                    d, key=f"{f.name}.{d.key}", default=values.get(f"{f.name}.{d.key}", d.default)
                )
                for d in nested
            ]
        else:
            out.append(
                KeyDoc(
                    f.name,
                    _type_text(f.type),
                    values.get(f.name, dataclasses.MISSING),
                    comments.get(f.name, ""),
                )
            )
    if defaults:
        out = [dataclasses.replace(d, default=defaults[d.key]) if d.key in defaults else d for d in out]
    return out


def help_section(
    cls: type,
    *,
    defaults: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
    title: str = "config keys (a YAML file or key.sub=value sets any of them):",
    width: int = 100,
) -> str:
    """The "config keys" section of a command's --help: each dotted key with its type and default
    (`defaults` over the dataclass's), the flag that sets it (`flags`: key -> flag), and its
    comment from the dataclass's source, wrapped under it."""
    lines = [title]
    for d in describe(cls, defaults):
        head = f"  {d.key}: {d.type}" + (" (required)" if d.required else f" = {show_value(d.default)}")
        if flags and d.key in flags:
            head += f"  [{flags[d.key]}]"
        lines.append(head)
        if d.comment:
            lines += textwrap.wrap(d.comment, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a paragraph of indented lines (the config keys) is printed
    as laid out instead of re-wrapped; descriptions of one paragraph wrap as before."""

    def _fill_text(self, text: Any, width: int, indent: str) -> str:
        parts = str(text).split("\n\n")
        fill = super()._fill_text
        return "\n\n".join(
            textwrap.indent(p, indent) if "\n  " in p else fill(p, width, indent) for p in parts
        )


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's raw-description formatter, taking the config keys section too."""

    def _fill_text(self, text: Any, width: int, indent: str) -> str:
        return super()._fill_text(str(text), width, indent)


class _Deferred:
    """Text made when --help is printed (reading the source for comments takes ~10 ms a class)."""

    def __init__(self, make: Callable[[], str]) -> None:
        self._make, self._text = make, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._make()
        return self._text

    def __contains__(self, part: str) -> bool:
        return part in str(self)


def add_config_help(parser: argparse.ArgumentParser, cls: type | Callable[[], type], **kwargs: Any) -> None:
    """End `parser`'s --help with `help_section(cls, **kwargs)` (after any epilog it has), made
    when the help is printed. `cls` may be a function returning the class, for a command whose
    config imports heavy modules (called only when the help is printed)."""
    get = (lambda: cls) if isinstance(cls, type) else cls
    before = parser.epilog
    parser.epilog = _Deferred(  # type: ignore[assignment]
        lambda: f"{before}\n\n{help_section(get(), **kwargs)}" if before else help_section(get(), **kwargs)
    )
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawHelpFormatter if raw else HelpFormatter


def show_value(value: Any) -> str:
    """A default as written in YAML or key=value: null, true, 3, "text", [1, 2]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    return repr(value)


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comments directly above its line(s) and beside them, read from the
    source of the class that declares it (a subclass's own over its bases'). Pragmas (noqa, type:,
    fmt:) are left out; a class without source has none."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_own_comments(klass))
    return out


# ---- helpers ---------------------------------------------------------------------------------------
_PRAGMA = re.compile(r"(noqa|type:|fmt:|pragma|pyright:)", re.IGNORECASE)


def _own_comments(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether it is alone on its line)
    lines = source.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                alone = not lines[tok.start[0] - 1][: tok.start[1]].strip()
                comments[tok.start[0]] = (text, alone)
        (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)][:1]
    except (tokenize.TokenError, SyntaxError, ValueError):
        return {}
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        end = stmt.end_lineno or stmt.lineno
        beside = [comments[n][0] for n in range(stmt.lineno, end + 1) if n in comments and not comments[n][1]]
        text = " ".join(t for t in above + beside if t and not _PRAGMA.match(t))
        if text:
            out[stmt.target.id] = text
    return out


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _flat_defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> default of every key of `cls` that has one (a section's default instance
    gives its keys' defaults)."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, default = prefix + f.name, _default(f)
        sub = _dataclass_type(hints[f.name])
        if sub is None:
            if default is not dataclasses.MISSING:
                out[key] = default
        elif default is dataclasses.MISSING:
            out.update(_flat_defaults(sub, key + "."))
        else:
            out.update(_flat_values(default, key + "."))
    return out


def _flat_values(obj: Any, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(_flat_values(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


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
