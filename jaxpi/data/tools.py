"""Pi's four tools as OpenAI-style function schemas, and a validator for the JSON-schema subset they use.

The schemas are those of the `pi` coding agent (npm @mariozechner/pi-coding-agent 0.73.1,
`dist/core/tools/{read,bash,edit,write}.js`): the same property names, types, required keys and
`additionalProperties: false` where Pi sets it. They are what the chat template lists under
`# Tools`, and what the admission gates check every tool call against.

The validator covers exactly the subset these schemas use (object/properties/required/
additionalProperties, array/items, string, number, integer, boolean); anything else in a schema is an
error, so a richer schema cannot silently pass unchecked.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

_MAX_LINES = 2000  # Pi's DEFAULT_MAX_LINES (truncate.js)
_MAX_KB = 50  # Pi's DEFAULT_MAX_BYTES / 1024


def _fn(name: str, description: str, properties: dict, required: list[str], **extra: Any) -> dict:
    params = {"type": "object", "properties": properties, "required": required, **extra}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def _str(description: str) -> dict:
    return {"type": "string", "description": description}


def _num(description: str) -> dict:
    return {"type": "number", "description": description}


_TOOLS: tuple[dict, ...] = (
    _fn(
        "read",
        "Read the contents of a file. Supports text files and images (jpg, png, gif, webp). Images are "
        f"sent as attachments. For text files, output is truncated to {_MAX_LINES} lines or {_MAX_KB}KB "
        "(whichever is hit first). Use offset/limit for large files. When you need the full file, "
        "continue with offset until complete.",
        {
            "path": _str("Path to the file to read (relative or absolute)"),
            "offset": _num("Line number to start reading from (1-indexed)"),
            "limit": _num("Maximum number of lines to read"),
        },
        ["path"],
    ),
    _fn(
        "bash",
        "Execute a bash command in the current working directory. Returns stdout and stderr. Output is "
        f"truncated to last {_MAX_LINES} lines or {_MAX_KB}KB (whichever is hit first). If truncated, full "
        "output is saved to a temp file. Optionally provide a timeout in seconds.",
        {
            "command": _str("Bash command to execute"),
            "timeout": _num("Timeout in seconds (optional, no default timeout)"),
        },
        ["command"],
    ),
    _fn(
        "edit",
        "Edit a single file using exact text replacement. Every edits[].oldText must match a unique, "
        "non-overlapping region of the original file. If two changes affect the same block or nearby "
        "lines, merge them into one edit instead of emitting overlapping edits. Do not include large "
        "unchanged regions just to connect distant changes.",
        {
            "path": _str("Path to the file to edit (relative or absolute)"),
            "edits": {
                "type": "array",
                "description": "One or more targeted replacements. Each edit is matched against the "
                "original file, not incrementally. Do not include overlapping or nested edits. If two "
                "changes touch the same block or nearby lines, merge them into one edit instead.",
                "items": {
                    "type": "object",
                    "properties": {
                        "oldText": _str(
                            "Exact text for one targeted replacement. It must be unique in the original "
                            "file and must not overlap with any other edits[].oldText in the same call."
                        ),
                        "newText": _str("Replacement text for this targeted edit."),
                    },
                    "required": ["oldText", "newText"],
                    "additionalProperties": False,
                },
            },
        },
        ["path", "edits"],
        additionalProperties=False,
    ),
    _fn(
        "write",
        "Write content to a file. Creates the file if it doesn't exist, overwrites if it does. "
        "Automatically creates parent directories.",
        {
            "path": _str("Path to the file to write (relative or absolute)"),
            "content": _str("Content to write to the file"),
        },
        ["path", "content"],
    ),
)

PI_TOOL_NAMES: tuple[str, ...] = tuple(t["function"]["name"] for t in _TOOLS)


def pi_tools() -> list[dict]:
    """A fresh copy of Pi's four tool schemas (read, bash, edit, write), OpenAI function form."""
    return copy.deepcopy(list(_TOOLS))


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema, for OpenAI-style tool dicts (or bare {name, parameters}).

    A tool that is not an object with a string `name` and an object (or absent) `parameters` is a
    ValueError naming its index.
    """
    out: dict[str, dict] = {}
    for i, t in enumerate(pi_tools() if tools is None else tools):
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] is not a function with a string name: {str(t)[:60]}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ValueError(
                f"tools[{i}] ({fn['name']}): parameters must be an object, not {type(params).__name__}"
            )
        out[fn["name"]] = params
    return out


_SCALARS = {
    "string": lambda v: isinstance(v, str),
    # JSON has one number type; bool is not a number even though Python says it is an int.
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}
_KNOWN_KEYS = {"type", "description", "properties", "required", "additionalProperties", "items"}


def validate(schema: Mapping[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """Every way `value` breaks `schema` (empty when it conforms), each naming the JSON path.

    Objects reject unknown keys unless the schema says `additionalProperties: true`: a tool call
    with a misspelt argument is malformed data for SFT even where the harness would have ignored it.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"schema at {where} is not an object: {str(schema)[:60]}")
    unknown = set(schema) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"schema at {where} uses unsupported keywords {sorted(unknown)}")
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(props, Mapping):
            raise ValueError(f"schema at {where}: properties must be an object, not {type(props).__name__}")
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError(f"schema at {where}: required must be a list of names")
        if not isinstance(schema.get("additionalProperties", False), bool):
            raise ValueError(f"schema at {where}: additionalProperties must be true or false")
        if not isinstance(value, dict):
            return [f"{where}: expected object, got {type(value).__name__}"]
        errors = [
            f"{where}: missing required key {k!r}" for k in schema.get("required", []) if k not in value
        ]
        if not schema.get("additionalProperties", False):
            errors += [f"{where}: unknown key {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += validate(props[k], v, f"{where}.{k}")
        return errors
    if kind == "array":
        if not isinstance(value, list):
            return [f"{where}: expected array, got {type(value).__name__}"]
        items = schema.get("items")
        if items is not None and not isinstance(items, Mapping):
            raise ValueError(f"schema at {where}: items must be an object, not {type(items).__name__}")
        errs: list[str] = []
        for i, v in enumerate(value):
            errs += validate(items, v, f"{where}[{i}]") if items else []
        return errs
    if isinstance(kind, str) and kind in _SCALARS:
        return [] if _SCALARS[kind](value) else [f"{where}: expected {kind}, got {type(value).__name__}"]
    raise ValueError(f"schema at {where} has unsupported type {kind!r}")
