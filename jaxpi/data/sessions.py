"""Read agent sessions (Pi v3 session files or OpenAI-style chat records) into one in-memory form.

Two input formats, told apart per file by its first line:

* **Pi session files** (JSONL, version 3; `docs/session-format.md` of @mariozechner/pi-coding-agent):
  a header `{"type": "session", ...}` then entries linked by `id`/`parentId`. We follow Pi's own
  `buildSessionContext`: the active leaf is the last entry in file order; the path is leaf -> root
  via `parentId`, reversed. On that path `message` entries give user/assistant/toolResult messages,
  `custom_message` and `branch_summary` become user-side context (the branch summary wrapped in Pi's
  `<summary>` preamble), and the last `compaction` replaces everything before it with its summary
  (as a user message, Pi's preamble) followed by the entries from `firstKeptEntryId` on.
  `custom`, `label`, `session_info` and `model_change` entries carry no context.
* **OpenAI-style JSONL**: one record per line, `{"messages": [...], "tools": [...], "meta": {...}}`,
  assistant messages with optional `reasoning_content` and `tool_calls`
  (`{id, type: "function", function: {name, arguments}}`, arguments a JSON string or an object),
  tool messages with `tool_call_id`.

Metadata of a Pi session (effort, verifier outcome, task id) comes from, later sources winning:
  1. the last `thinking_level_change` entry on the active path (`thinkingLevel` is the effort);
  2. the last `custom` entry on the active path with `customType: "jaxpi.attempt"` and
     `data: {"task_id": str, "verified": bool, "effort": str}` (any key may be missing), which the
     rollout harness appends once the verifier has run;
  3. a sidecar `<file>.meta.json` with the same keys.
For OpenAI records the `meta` object of the record holds the same keys.

Everything is normalised to `Session.messages` in transformers chat form: roles system/user/
assistant/tool, assistant `content` (str), optional `reasoning_content` (str) and `tool_calls`
whose `function.arguments` is always a dict.

Every field we read goes through a strict typed schema (pydantic, no coercion: `"false"` is not a
boolean, `3` is not a string; `jaxpi.data.schema`), so a record either reads exactly as written or
is rejected. Sessions we cannot represent (images, assistant turns that errored) are not read
errors either: like undecodable bytes, invalid JSON, wrongly typed or missing fields and over-long
lines they come back as `Rejection`s with a reason key and a detail, each naming `file:line` (a
sidecar by its own path). Nothing in a file ends the read of the next line or the next file. Lines are split on "\\n"
only (JSON strings may hold U+2028 and other Unicode line breaks raw), read at most
`ReadLimits.max_line_bytes` at a time, and a Pi file stops being read once it passes
`ReadLimits.max_session_bytes`.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from jaxpi.data.schema import (
    AttemptMeta,
    Block,
    OAAssistant,
    OAFunction,
    OAMessage,
    OAPart,
    OARecord,
    OAToolCall,
    OAToolMessage,
    PiAssistant,
    PiBashExecution,
    PiBranchSummary,
    PiCompaction,
    PiCustom,
    PiCustomMessage,
    PiEntry,
    PiHeader,
    PiMessageEntry,
    PiSummaryMessage,
    PiThinkingLevel,
    PiToolResult,
    PiUser,
    Role,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolFunction,
    ToolSpec,
    _json_type,
    _need_dict,
    _RecordError,
    _short,
    _typed,
)

# Pi's context preambles (dist/core/messages.js), so summaries read as the model saw them.
COMPACTION_PREFIX = (
    "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
)
COMPACTION_SUFFIX = "\n</summary>"
BRANCH_PREFIX = "The following is a summary of a branch that this conversation came back from:\n\n<summary>\n"
BRANCH_SUFFIX = "</summary>"
ATTEMPT_TYPE = "jaxpi.attempt"
# a turn cut by the length limit never produced its end-of-turn token; errors and aborts are not behaviour
_BAD_STOPS = ("error", "aborted", "length")
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
    """One conversation in transformers chat form (see the module docstring).

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


def find_jsonl(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, directories expanded to their `*.jsonl` files (recursive, sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.jsonl") if q.is_file())
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
            yield _pi_file(path, _chain(pending, lines), limits)
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
# Pi session files


def _pi_file(path: Path, lines: Iterator[_Line], limits: ReadLimits) -> Session | Rejection:
    """One Pi file is one session: its first fault rejects it (later faults are counted)."""
    entries: list[tuple[int, Any]] = []
    faults: list[tuple[int, str, str]] = []
    total = 0
    for ln in lines:
        total += ln.size
        if total > limits.max_session_bytes:
            return Rejection(
                f"{path}:{ln.no}",
                "session_too_large",
                f"session passes max_session_bytes {limits.max_session_bytes} at this line",
            )
        if ln.fault:
            faults.append((ln.no, *ln.fault))
        elif not ln.blank:
            entries.append((ln.no, ln.value))
    try:
        session = _pi_session(path, entries, faults)
    except _RecordError as r:
        if (r.line, r.reason, r.detail) not in faults:
            faults.append((r.line, r.reason, r.detail))
    except _SidecarError as e:
        return Rejection(str(e.path), "bad_sidecar", e.detail, session=str(path))
    if faults:
        line, reason, detail = min(faults)
        others = sorted({ln for ln, _, _ in faults} - {line})
        if others:
            shown = ", ".join(map(str, others[:5])) + (", ..." if len(others) > 5 else "")
            detail += f" (and faults on {len(others)} more lines: {shown})"
        return Rejection(f"{path}:{line}", reason, detail)
    return session


def _pi_entry(line: int, obj: Any) -> PiEntry:
    obj = _need_dict(obj, line, "entry")
    base = _typed(PiEntry, obj, line)
    model = {
        "thinking_level_change": PiThinkingLevel,
        "compaction": PiCompaction,
        "branch_summary": PiBranchSummary,
        "custom_message": PiCustomMessage,
        "custom": PiCustom,
        "message": PiMessageEntry,
    }.get(base.type)
    return base if model is None else _typed(model, obj, line)


def _pi_session(path: Path, lines: list[tuple[int, Any]], faults: list) -> Session:
    if not lines:
        raise _RecordError(1, "empty_session", "no entries")
    header_line, raw_header = lines[0]
    header = _typed(PiHeader, _need_dict(raw_header, header_line, "header"), header_line)
    if type(header.version) is not int or header.version != 3:
        raise _RecordError(header_line, "unsupported_version", f"session version {header.version!r}, not 3")
    body: list[tuple[int, PiEntry]] = []
    for ln, obj in lines[1:]:
        try:
            body.append((ln, _pi_entry(ln, obj)))
        except _RecordError as r:
            faults.append((r.line, r.reason, r.detail))  # go on: every faulty line is counted
    if faults:
        raise _RecordError(*min(faults))
    if not body:
        raise _RecordError(header_line, "empty_session", "header without entries")
    by_id: dict[str, tuple[int, PiEntry]] = {}
    for ln, e in body:
        if e.id in by_id:
            raise _RecordError(ln, "duplicate_id", f"entry id {e.id!r} is also used on line {by_id[e.id][0]}")
        by_id[e.id] = (ln, e)
    path_entries: list[tuple[int, PiEntry]] = []
    cur: tuple[int, PiEntry] | None = body[-1]
    while cur is not None:
        path_entries.append(cur)
        parent = cur[1].parentId
        if parent is not None and parent not in by_id:
            raise _RecordError(cur[0], "unknown_parent", f"parentId {parent!r} names no entry")
        cur = by_id[parent] if parent is not None else None
        if len(path_entries) > len(body):
            raise _RecordError(body[-1][0], "cycle", "parentId links form a cycle")
    path_entries.reverse()

    meta: dict[str, Any] = {}
    compaction_at = None
    for k, (ln, e) in enumerate(path_entries):
        if isinstance(e, PiThinkingLevel):
            meta["effort"] = e.thinkingLevel
        elif isinstance(e, PiCompaction):
            compaction_at = k
        elif isinstance(e, PiCustom) and e.customType == ATTEMPT_TYPE:
            data = _typed(AttemptMeta, {} if e.data is None else e.data, ln, "data")
            meta.update(data.model_dump(include=data.model_fields_set))

    context = path_entries
    messages: list[dict] = []
    where: list[int] = []
    if compaction_at is not None:
        ln, comp = path_entries[compaction_at]
        assert isinstance(comp, PiCompaction)
        messages.append({"role": "user", "content": COMPACTION_PREFIX + comp.summary + COMPACTION_SUFFIX})
        where.append(ln)
        before = path_entries[:compaction_at]
        ids = [e.id for _, e in before]
        kept = before[ids.index(comp.firstKeptEntryId) :] if comp.firstKeptEntryId in ids else []
        context = kept + path_entries[compaction_at + 1 :]
    for ln, e in context:
        new = _pi_entry_messages(ln, e)
        messages += new
        where += [ln] * len(new)
    if not messages:
        raise _RecordError(
            path_entries[-1][0], "empty_session", "the active branch (its leaf is here) holds no messages"
        )
    sidecar = _sidecar(path)
    if sidecar is not None:
        meta.update(sidecar)
    return Session(
        messages=messages,
        tools=None,
        meta=SessionMeta(source=str(path), **meta),
        locations=tuple(f"{path}:{ln}" for ln in where),
    )


def _sidecar(path: Path) -> dict[str, Any] | None:
    """The typed keys a `<file>.meta.json` sets, or None without one; faults name the sidecar."""
    sidecar = path.with_name(path.name + ".meta.json")
    if not sidecar.exists():
        return None
    try:
        with open(sidecar, "rb") as fh:
            raw = fh.read(2**20 + 1)
    except OSError as e:
        raise _SidecarError(sidecar, f"cannot read: {e.strerror or e}") from None
    if len(raw) > 2**20:
        raise _SidecarError(sidecar, "larger than 1 MiB")
    value, fault = _parse(raw, first=True)
    if fault:
        raise _SidecarError(sidecar, fault[1])
    try:
        meta = _typed(AttemptMeta, _need_dict(value, 1, "sidecar"), 1)
    except _RecordError as r:
        raise _SidecarError(sidecar, r.detail) from None
    return meta.model_dump(include=meta.model_fields_set)


class _SidecarError(Exception):
    def __init__(self, path: Path, detail: str):
        super().__init__(detail)
        self.path, self.detail = path, detail


def _pi_text(content: Any, line: int, where: str) -> str:
    """User/custom/toolResult content: a string or text blocks; images cannot be trained on here."""
    if isinstance(content, str):
        return content
    parts = []
    for i, b in enumerate(content):
        kind = _typed(Block, b, line, f"{where}[{i}]").type
        if kind == "image":
            raise _RecordError(line, "image_content", "image blocks are not supported")
        if kind != "text":
            raise _RecordError(line, "bad_field", f"{where}[{i}]: unexpected content block {kind!r}")
        parts.append(_typed(TextBlock, b, line, f"{where}[{i}]").text)
    return "\n".join(parts)


def _pi_entry_messages(line: int, e: PiEntry) -> list[dict]:
    if isinstance(e, PiCustomMessage):
        return [{"role": "user", "content": _pi_text(e.content, line, "content")}]
    if isinstance(e, PiBranchSummary):
        return [{"role": "user", "content": BRANCH_PREFIX + e.summary + BRANCH_SUFFIX}] if e.summary else []
    if not isinstance(e, PiMessageEntry):
        return []  # custom, label, session_info, model_change, thinking_level_change: no context
    m = e.message
    role = _typed(Role, m, line, "message").role
    if role == "user":
        user = _typed(PiUser, m, line, "message")
        return [{"role": "user", "content": _pi_text(user.content, line, "message.content")}]
    if role == "assistant":
        return [_pi_assistant(_typed(PiAssistant, m, line, "message"), line)]
    if role == "toolResult":
        r = _typed(PiToolResult, m, line, "message")
        return [
            {
                "role": "tool",
                "tool_call_id": r.toolCallId,
                "name": r.toolName,
                "content": _pi_text(r.content, line, "message.content"),
            }
        ]
    if role == "bashExecution":
        # `!cmd` runs by the user reach the model as a user message (Pi's bashExecutionToText).
        b = _typed(PiBashExecution, m, line, "message")
        if b.excludeFromContext:
            return []
        text = f"Ran `{b.command}`\n" + (f"```\n{b.output}\n```" if b.output else "(no output)")
        if b.cancelled:
            text += "\n\n(command cancelled)"
        elif b.exitCode not in (None, 0):
            text += f"\n\nCommand exited with code {b.exitCode}"
        if b.truncated and b.fullOutputPath:
            text += f"\n\n[Output truncated. Full output: {b.fullOutputPath}]"
        return [{"role": "user", "content": text}]
    if role in ("custom", "branchSummary", "compactionSummary"):
        s = _typed(PiSummaryMessage, m, line, "message")
        content = s.content if s.content is not None else (s.summary or "")
        return [{"role": "user", "content": _pi_text(content, line, "message.content")}]
    raise _RecordError(line, "bad_field", f"message.role: unknown message role {role!r}")


def _pi_assistant(m: PiAssistant, line: int) -> dict:
    if m.stopReason in _BAD_STOPS:
        raise _RecordError(line, "assistant_error", f"assistant turn stopped with {m.stopReason!r}")
    thinking, text, calls = [], [], []
    for i, b in enumerate(m.content):
        where = f"message.content[{i}]"
        t = _typed(Block, b, line, where).type
        if t == "thinking":
            thinking.append(_typed(ThinkingBlock, b, line, where).thinking)
        elif t == "text":
            text.append(_typed(TextBlock, b, line, where).text)
        elif t == "toolCall":
            c = _typed(ToolCallBlock, b, line, where)
            calls.append(
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            )
        elif t == "image":
            raise _RecordError(line, "image_content", "image blocks are not supported")
        else:
            raise _RecordError(line, "bad_field", f"{where}: unexpected assistant block {t!r}")
    out: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(x for x in text if x)}
    reasoning = "\n\n".join(x for x in thinking if x)
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


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
