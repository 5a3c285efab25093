"""The command-line side of the one config system: flags that set config keys, `--config
FILE_OR_NAME` and trailing `key.sub=value` overrides.

    SERVE = ConfigSpec(ServeConfig, "serve", (Flag("--model", "model", "checkpoint dir"), ...))
    add_config_arguments(parser, SERVE)       # the flags, --config, overrides, the config-keys help
    cfg = build_config(args)                  # a ServeConfig

Each command declares once which flag sets which dotted key (`Flag`). A flag the user did not give
is absent from the parsed arguments (argparse.SUPPRESS), so it never hides the file's value. The
layers, each over the one before: the dataclass's defaults, the command's own `defaults`, the
`--config` file (a bare NAME is configs/<group>/NAME.yaml), the flags given, the overrides. Bad
input is a `ConfigError` (a ValueError): `jaxpi CMD: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpi.configfile import (
    ConfigError,
    config_data,
    from_dict,
    has_key,
    preset_names,
    required_keys,
    resolve_path,
)
from jaxpi.configfile.help import add_config_help, default_note, has_default, key_defaults

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# A trailing `key.sub=value` (a path such as runs/a=1 is not one: it has a slash before the `=`).
OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line argument and the config key it sets."""

    flag: str  # "--max-len", or a positional's name ("task")
    key: str  # the dotted config key it sets
    help: str | None = None
    # argparse's type; None: int or float from the field's annotation, else the text as given
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    nargs: str | None = None  # positionals only: "+" or "*" (key=value items among them are overrides)
    # the parsed value -> the field's value (e.g. shlex.split of one string)
    convert: Callable[[Any], Any] | None = None

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """A command's config: its dataclass, its preset directory and the flags that set its keys."""

    cls: type
    group: str  # a bare --config NAME is configs/<group>/NAME.yaml
    flags: tuple[Flag, ...]
    # the command's own defaults over the dataclass's (dotted key -> value)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def preset_dir(self) -> Path:
        return CONFIG_DIR / self.group


class _Parser(argparse.ArgumentParser):
    """Options and positionals in any order (`TASK --endpoint URL level=high`): argparse's
    intermixed parsing, which a subcommand's parser does not get by default."""

    _mixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


def add_command_parser(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """`sub.add_parser(name, **kwargs)`, as a parser that takes key=value items after options."""
    kind = sub._parser_class
    sub._parser_class = _Parser
    try:
        return sub.add_parser(name, **kwargs)
    finally:
        sub._parser_class = kind


def add_config_arguments(p: argparse.ArgumentParser, spec: ConfigSpec) -> None:
    """Add `spec`'s flags (absent unless given), `--config`, the trailing overrides, and end the
    help with every config key, its type, default and comment."""
    hints = typing.get_type_hints(spec.cls)
    defaults = key_defaults(spec.cls, spec.defaults)
    for f in spec.flags:
        kwargs: dict[str, Any] = {"help": f.help}
        hint = _hint(hints, f.key)
        if f.positional:
            if f.nargs:
                kwargs["nargs"] = f.nargs
        else:
            kwargs["default"] = argparse.SUPPRESS  # the config's value stands unless the flag is given
            value = defaults.get(f.key)
            if has_default(value) and "default" not in (f.help or "").lower():
                note = default_note(value)
                kwargs["help"] = f"{f.help} {note}" if f.help else note
        if hint is bool and not f.positional:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = f.type or _arg_type(hint)
            if f.choices is not None:
                kwargs["choices"] = f.choices
            if f.metavar:
                kwargs["metavar"] = f.metavar
        p.add_argument(f.flag, **kwargs)
    names = preset_names(spec.preset_dir)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE_OR_NAME",
        help=f"a YAML config: a file, or NAME for configs/{spec.group}/NAME.yaml"
        + (f" ({', '.join(names)})" if names else "")
        + "; the flags given and key=value override it",
    )
    if not any(f.positional and f.nargs for f in spec.flags):
        p.add_argument(
            "overrides", nargs="*", metavar="key.sub=value", help="set any config key (listed below)"
        )
    add_config_help(
        p,
        spec.cls,
        defaults=spec.defaults,
        flags={f.key: f.flag for f in spec.flags},
        title="config keys (--config FILE, then the flags given, then key.sub=value; each over the one "
        "before):",
    )
    p.set_defaults(config_spec=spec)


def build_config(args: argparse.Namespace, spec: ConfigSpec | None = None) -> Any:
    """The config of parsed arguments: defaults, the --config file, the flags given, overrides."""
    spec = spec or args.config_spec
    values: dict[str, Any] = {}
    overrides = list(getattr(args, "overrides", None) or [])
    for f in spec.flags:
        if not hasattr(args, f.dest):
            continue
        value = getattr(args, f.dest)
        if f.positional and f.nargs:  # key=value items among the positionals are overrides
            overrides += [v for v in value if OVERRIDE.match(v)]
            value = [v for v in value if not OVERRIDE.match(v)]
            if not value and f.nargs == "+":
                raise ConfigError(f"give at least one {f.metavar or f.dest}")
        values[f.key] = f.convert(value) if f.convert else value
    path = resolve_path(args.config, spec.preset_dir) if getattr(args, "config", None) else None
    data = config_data(spec.cls, path, overrides, defaults=spec.defaults, values=values)
    flags = {f.key: f.flag for f in spec.flags}
    for key in required_keys(spec.cls):
        if not has_key(data, key):
            how = f"{flags[key]} or {key}=..." if key in flags else f"{key}=..."
            raise ConfigError(f"{key} is required: give {how} (or set it in the --config file)")
    return from_dict(spec.cls, data, where=str(path) if path else "")


def _hint(hints: Mapping[str, Any], key: str) -> Any:
    """The annotation of dotted `key` (a section's field through its dataclass's hints)."""
    first, _, rest = key.partition(".")
    hint = hints[first]
    return _hint(typing.get_type_hints(hint), rest) if rest else hint


def _arg_type(hint: Any) -> Callable[[str], Any] | None:
    """argparse's type for a field: int or float (also of `X | None`); None keeps the text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return hint if hint in (int, float) else None
