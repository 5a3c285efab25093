"""A command's generated --help keys: every settable key of a config dataclass with its type,
default and the `#` comment above or beside its field in the source.

    add_config_help(parser, SFTConfig)   # --help ends with help_section(SFTConfig), made on demand

The comments are read from the dataclass's source (`inspect`, `tokenize`, `ast`), so the help
cannot drift from the code; reading them costs ~10 ms a class and happens only when help prints.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Mapping
from typing import Any

from jaxpi.configfile import _dataclass_type, key_name


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
        sub, name = _dataclass_type(hints[f.name]), key_name(f.name)
        if sub is not None:
            nested = describe(sub)
            out += [
                dataclasses.replace(
                    d, key=f"{name}.{d.key}", default=values.get(f"{name}.{d.key}", d.default)
                )
                for d in nested
            ]
        else:
            out.append(
                KeyDoc(
                    name,
                    _type_text(f.type),
                    values.get(name, dataclasses.MISSING),
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


def key_defaults(cls: type, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Dotted key -> default of every key of `cls` that has one (`defaults` over the dataclass's);
    no source is read, so a parser may ask for it when it is built."""
    return {**_flat_defaults(cls), **(defaults or {})}


def default_note(value: Any) -> str:
    """ "(default: VALUE)" for a flag's help, VALUE as `show_value` writes it (argparse %-formats
    help strings: a `%` in the value is doubled)."""
    return f"(default: {show_value(value)})".replace("%", "%%")


def shows_default(action: argparse.Action) -> bool:
    """Whether `action`'s --help line should state its default: it takes a value and has one
    (`has_default`; an on/off switch, --help and --version have none to state)."""
    if action.nargs == 0 or isinstance(action, (argparse._SubParsersAction, argparse._VersionAction)):
        return False
    return has_default(action.default) and action.default is not argparse.SUPPRESS


def has_default(value: Any) -> bool:
    """Whether a default is worth stating: not None, not an off switch, not an empty list or text."""
    return value is not None and not isinstance(value, bool) and value not in ((), [], "")


def add_defaults(parser: argparse.ArgumentParser) -> None:
    """State every default in `parser`'s --help and its subcommands' (what argparse's
    ArgumentDefaultsHelpFormatter does, for flags without a help string too and whatever
    formatter a parser has): "(default: %(default)s)" after each help that does not say it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                add_defaults(child)
        elif shows_default(action) and "default" not in (action.help or "").lower():
            action.help = f"{action.help} (default: %(default)s)" if action.help else "(default: %(default)s)"


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
        key, default = prefix + key_name(f.name), _default(f)
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
            out.update(_flat_values(value, f"{prefix}{key_name(f.name)}."))
        else:
            out[prefix + key_name(f.name)] = value
    return out
