"""What the session readers (`jaxpi.data.sessions`, `jaxpi.data.pi_sessions`) hand out, and the
JSON lines they parse: `Session`, `SessionMeta`, `Rejection`, `ReadLimits`, the reasons a record is
not read, and one line's bytes -> JSON value with its fault named.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

# Why a record was not read (Rejection.reason); the gates add their own (jaxpi.data.gates).
READ_REASONS = (
    "unreadable_file",  # the file could not be opened or read (permissions, I/O error)
    "line_too_long",  # a line over ReadLimits.max_line_bytes
    "session_too_large",  # a Pi file over ReadLimits.max_session_bytes
    "invalid_utf8",  # bytes that are not UTF-8 text
    "invalid_json",  # text that is not one JSON value (or nests deeper than the parser allows)
    "missing_field",  # a required field is absent
    "bad_field",  # a field of the wrong type or an unknown value (role, block type)
    "bad_arguments",  # OpenAI tool-call arguments that are not a JSON object
    "unsupported_version",  # a Pi header that is not version 3
    "empty_session",  # a Pi header without entries
    "duplicate_id",  # two Pi entries with one id
    "unknown_parent",  # a parentId that names no entry
    "cycle",  # parentId links that loop
    "image_content",  # image blocks: not trainable here
    "assistant_error",  # an assistant turn that stopped with an error, an abort or the length limit
    "bad_sidecar",  # `<file>.meta.json` unreadable or wrongly typed
    "unknown_entry",  # a Pi entry type that neither release jaxpi reads (0.73, 1.x) writes
    "unknown_target",  # a Pi `context_edit` whose targetId names no entry of the context
    "context_edit",  # a Pi `context_edit` that no one rendering honours (jaxpi.data.pi_sessions)
    "system_changed",  # Pi 1.x: the system prompt or tools changed after an assistant turn
    "mixed_effort",  # Pi 1.x: assistant turns requested at different thinking levels
)


class DataError(ValueError):
    """A record that cannot be read; the message starts with `file:line`."""


@dataclass(frozen=True)
class ReadLimits:
    """Caps on what the reader takes in, so that a hostile file costs milliseconds, not minutes.

    max_line_bytes: longest line (one Pi entry, one OpenAI record) read; a longer one is rejected
      (`line_too_long`) after skipping it in chunks, never held whole. The default, 4 MiB, is
      about a million tokens: several times Qwen3.5's whole context in one entry.
    max_session_bytes: largest Pi session file read (`session_too_large`); a Pi file keeps every
      branch and everything before a compaction, so this is generous.
    """

    max_line_bytes: int = 4 * 2**20
    max_session_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_line_bytes", "max_session_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReadLimits.{name} must be a positive integer, not {v!r}")


@dataclass(frozen=True)
class SessionMeta:
    """Where a session came from and what is known about it (None = unknown)."""

    source: str  # "path" for a Pi file, "path:line" for an OpenAI record
    effort: str | None = None
    verified: bool | None = None
    task_id: str | None = None


@dataclass(frozen=True)
class Session:
    """One conversation in transformers chat form (the form `jaxpi.data.sessions` describes).

    `locations[i]` is the `file:line` that message i was read from (empty for sessions built in
    code), so that later checks can name the line of a fault.
    """

    messages: list[dict]
    tools: list[dict] | None
    meta: SessionMeta
    locations: tuple[str, ...] = ()

    def location(self, i: int) -> str:
        """`file:line` of message `i` (the session's source when unknown)."""
        if self.locations and -len(self.locations) <= i < len(self.locations):
            return self.locations[i]
        return self.meta.source


@dataclass(frozen=True)
class Rejection:
    """A record that was not turned into a Session (or a session the gates excluded).

    `reason` is a short key, `detail` says why, `source` names where (`file:line`, or the sidecar's
    path); `session` is the session's own source when that differs from `source`.
    """

    source: str
    reason: str
    detail: str = ""
    session: str = ""


@dataclass(frozen=True)
class _Line:
    no: int
    size: int  # bytes, newline included
    value: Any = None
    fault: tuple[str, str] | None = None  # (reason, detail)
    blank: bool = False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads accepts NaN/Infinity; JSON does not


def _parse(raw: bytes, first: bool) -> tuple[Any, tuple[str, str] | None]:
    """(value, None) or (None, (reason, detail)) for one line's bytes."""
    if first and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ("invalid_utf8", f"not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 4]!r})")
    return _json(text)


def _json(text: str) -> tuple[Any, tuple[str, str] | None]:
    try:
        return json.loads(text, parse_constant=_reject_constant), None
    except json.JSONDecodeError as e:
        return None, ("invalid_json", f"undecodable JSON ({e.msg} at column {e.colno})")
    except ValueError as e:  # NaN/Infinity, integers longer than Python reads
        return None, ("invalid_json", f"undecodable JSON ({e})")
    except RecursionError:
        return None, ("invalid_json", "JSON nested too deeply to read")
