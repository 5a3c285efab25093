"""Read agent sessions (Pi session files or OpenAI-style chat records) into one in-memory form.

Two input formats, told apart per file by its first line:

* **Pi session files** (JSONL, version 3, as Pi 0.73 and Pi 1.x write them): a header
  `{"type": "session", ...}` then entries linked by `id`/`parentId`; one file is one session,
  read by `jaxpi.data.pi_sessions` (what Pi would send the model at the file's active leaf: the
  branch, compaction, 1.x's system messages and context edits, the metadata entries).
* **OpenAI-style JSONL**: one record per line, `{"messages": [...], "tools": [...], "meta": {...}}`,
  assistant messages with optional `reasoning_content` and `tool_calls`
  (`{id, type: "function", function: {name, arguments}}`, arguments a JSON string or an object),
  tool messages with `tool_call_id`; `meta` holds `effort`, `verified`, `task_id`.

Everything is normalised to `Session.messages` in transformers chat form: roles system/user/
assistant/tool, assistant `content` (str), optional `reasoning_content` (str) and `tool_calls`
whose `function.arguments` is always a dict; `Session.tools` the OpenAI tool schemas when the
record carries them (OpenAI records, Pi 1.x files).

Every field we read goes through a strict typed schema (pydantic, no coercion: `"false"` is not a
boolean, `3` is not a string; `jaxpi.data.schema`), so a record either reads exactly as written or
is rejected. Sessions we cannot represent (images, assistant turns that errored, entry types no
Pi release writes) are not read errors either: like undecodable bytes, invalid JSON, wrongly
typed or missing fields and over-long lines they come back as `Rejection`s with a reason key
(`READ_REASONS`) and a detail, each naming `file:line` (a sidecar by its own path). Nothing in a
file ends the read of the next line or the next file. Lines are split on "\\n" only (JSON strings
may hold U+2028 and other Unicode line breaks raw), read at most `ReadLimits.max_line_bytes` at a
time, and a Pi file stops being read once it passes `ReadLimits.max_session_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from jaxpi.data.pi_sessions import BRANCH_PREFIX, COMPACTION_PREFIX, pi_file
from jaxpi.data.schema import (
    AttemptMeta,
    OAAssistant,
    OAFunction,
    OAMessage,
    OAPart,
    OARecord,
    OAToolCall,
    OAToolMessage,
    Role,
    ToolFunction,
    ToolSpec,
    _json_type,
    _need_dict,
    _RecordError,
    _short,
    _typed,
)
from jaxpi.data.session_types import (
    READ_REASONS,
    DataError,
    ReadLimits,
    Rejection,
    Session,
    SessionMeta,
    _json,
    _Line,
    _parse,
)

__all__ = [
    "BRANCH_PREFIX",
    "COMPACTION_PREFIX",
    "READ_REASONS",
    "DataError",
    "ReadLimits",
    "Rejection",
    "Session",
    "SessionMeta",
    "find_jsonl",
    "read_sessions",
]


# Inside a directory, the Pi event stream the runner keeps beside each attempt's session (an
# attempt directory holds its record.json) is not a session: `jaxpi data check runs/eval/X/attempts`
# reads the sessions only. Named on its own, such a file is read (and refused) like any other.
EVENTS_NAME, RECORD_NAME = "events.jsonl", "record.json"


def _attempt_events(q: Path) -> bool:
    return q.name == EVENTS_NAME and (q.parent / RECORD_NAME).is_file()


def find_jsonl(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, directories expanded to their `*.jsonl` files (recursive, sorted; an
    attempt's event stream left out)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.jsonl") if q.is_file() and not _attempt_events(q))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def read_sessions(
    paths: Iterable[str | Path], *, strict: bool = False, limits: ReadLimits | None = None
) -> tuple[list[Session], list[Rejection]]:
    """Read every session under `paths`; bad records become Rejections (or DataError if `strict`)."""
    limits = limits or ReadLimits()
    sessions: list[Session] = []
    rejections: list[Rejection] = []
    for path in find_jsonl(paths):
        for item in _read_file(path, limits):
            if isinstance(item, Session):
                sessions.append(item)
            elif strict:
                raise DataError(f"{item.source}: {item.reason}: {item.detail}")
            else:
                rejections.append(item)
    return sessions, rejections


# ---------------------------------------------------------------------------------------------
# Lines: bytes -> JSON values, each fault named by its line


def _lines(fh: IO[bytes], limits: ReadLimits) -> Iterator[_Line]:
    cap = limits.max_line_bytes
    no, first = 0, True
    while True:
        raw = fh.readline(cap + 2)  # room for "\r\n" after a line of exactly `cap` bytes
        if not raw:
            return
        no += 1
        size = len(raw)
        body = raw[:-1] if raw.endswith(b"\n") else raw
        body = body[:-1] if body.endswith(b"\r") else body
        if len(body) > cap:
            while not raw.endswith(b"\n"):  # skip the rest of the line without holding it
                raw = fh.readline(1 << 20)
                if not raw:
                    break
                size += len(raw)
            yield _Line(no, size, fault=("line_too_long", f"line of {size} bytes > max_line_bytes {cap}"))
            first = False
            continue
        if not body.strip():
            yield _Line(no, size, blank=True)
            continue
        value, fault = _parse(body, first)
        first = False
        yield _Line(no, size, value, fault)


def _read_file(path: Path, limits: ReadLimits) -> Iterator[Session | Rejection]:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, also when the caller stops early
    except OSError as e:
        yield Rejection(str(path), "unreadable_file", f"cannot open: {e.strerror or e}")
        return
    try:
        lines = _lines(fh, limits)
        pending: list[_Line] = []
        first = None
        for ln in lines:
            pending.append(ln)
            if not ln.blank:
                first = ln
                break
        if first is None:
            return  # an empty file holds no sessions
        v = first.value
        if isinstance(v, dict) and v.get("type") == "session":
            yield pi_file(path, _chain(pending, lines), limits)
            return
        for ln in _chain(pending, lines):
            if ln.blank:
                continue
            if ln.fault:
                yield Rejection(f"{path}:{ln.no}", *ln.fault)
                continue
            try:
                yield _openai_record(path, ln.no, ln.value)
            except _RecordError as r:
                yield Rejection(f"{path}:{r.line}", r.reason, r.detail)
    except OSError as e:
        yield Rejection(str(path), "unreadable_file", f"read failed: {e.strerror or e}")
    finally:
        fh.close()


def _chain(first: list[_Line], rest: Iterator[_Line]) -> Iterator[_Line]:
    yield from first
    yield from rest


# ---------------------------------------------------------------------------------------------
# OpenAI-style records


def _openai_record(path: Path, line: int, value: Any) -> Session:
    rec = _typed(OARecord, _need_dict(value, line, "record"), line)
    tools = (
        None if rec.tools is None else [_tool_spec(t, line, f"tools[{i}]") for i, t in enumerate(rec.tools)]
    )
    meta = _typed(AttemptMeta, rec.meta, line, "meta") if rec.meta is not None else AttemptMeta()
    messages = [_openai_message(m, line, f"messages[{i}]") for i, m in enumerate(rec.messages)]
    source = f"{path}:{line}"
    return Session(
        messages=messages,
        tools=tools,
        meta=SessionMeta(source=source, effort=meta.effort, verified=meta.verified, task_id=meta.task_id),
        locations=(source,) * len(messages),
    )


def _tool_spec(t: Any, line: int, where: str) -> dict:
    """An OpenAI tool (`{"type": "function", "function": {...}}`, or the bare function object)."""
    t = _need_dict(t, line, where)
    if "function" in t:
        spec = _typed(ToolSpec, t, line, where)
        if spec.type not in (None, "function"):
            raise _RecordError(line, "bad_field", f"{where}.type must be 'function', not {spec.type!r}")
        _typed(ToolFunction, spec.function, line, f"{where}.function")
    else:
        _typed(ToolFunction, t, line, where)
    return t


_OA_MODELS: dict[str, type[OAMessage]] = {
    "system": OAMessage,
    "user": OAMessage,
    "assistant": OAAssistant,
    "tool": OAToolMessage,
}


def _openai_content(content: Any, line: int, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []  # OpenAI content parts
    for i, p in enumerate(content):
        part = _typed(OAPart, p, line, f"{where}[{i}]")
        if part.type not in ("text", None):
            raise _RecordError(line, "image_content", "non-text content parts are not supported")
        parts.append(part.text)
    return "".join(parts)


def _openai_message(value: Any, line: int, where: str) -> dict:
    role = _typed(Role, _need_dict(value, line, where), line, where).role
    model: Callable[..., Any] | None = _OA_MODELS.get(role)
    if model is None:
        raise _RecordError(line, "bad_field", f"{where}.role: unknown role {role!r}")
    m = _typed(model, value, line, where)
    out: dict[str, Any] = {"role": role, "content": _openai_content(m.content, line, f"{where}.content")}
    if isinstance(m, OAToolMessage):
        out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
    if isinstance(m, OAAssistant):
        if m.reasoning_content:
            out["reasoning_content"] = m.reasoning_content
        calls = [_openai_call(c, line, f"{where}.tool_calls[{i}]") for i, c in enumerate(m.tool_calls or [])]
        if calls:
            out["tool_calls"] = calls
    return out


def _openai_call(value: Any, line: int, where: str) -> dict:
    c = _typed(OAToolCall, _need_dict(value, line, where), line, where)
    fn = _typed(OAFunction, c.function, line, f"{where}.function")
    args = {} if fn.arguments is None else fn.arguments
    if isinstance(args, str):
        value, fault = _json(args) if args.strip() else ({}, None)
        if fault:
            raise _RecordError(
                line, "bad_arguments", f"{where}.function.arguments are not JSON: {args[:60]!r}"
            )
        if not isinstance(value, dict):
            raise _RecordError(
                line,
                "bad_arguments",
                f"{where}.function.arguments must be a JSON object, not {_json_type(value)}",
            )
        args = value
    elif not isinstance(args, dict):
        raise _RecordError(
            line,
            "bad_field",
            f"{where}.function.arguments must be an object or a JSON string, not {_json_type(args)} {_short(args)}",
        )
    return {"id": c.id, "type": "function", "function": {"name": fn.name, "arguments": args}}
