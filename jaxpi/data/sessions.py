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
whose `function.arguments` is always a dict. Sessions we cannot represent (images, assistant turns
that errored) are not read errors: they come back as `Rejection`s with a reason, like undecodable
lines and missing fields, each naming file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class DataError(ValueError):
    """A record that cannot be read; the message starts with `file:line`."""


@dataclass(frozen=True)
class SessionMeta:
    """Where a session came from and what is known about it (None = unknown)."""

    source: str  # "path" for a Pi file, "path:line" for an OpenAI record
    effort: str | None = None
    verified: bool | None = None
    task_id: str | None = None


@dataclass(frozen=True)
class Session:
    """One conversation in transformers chat form (see the module docstring)."""

    messages: list[dict]
    tools: list[dict] | None
    meta: SessionMeta


@dataclass(frozen=True)
class Rejection:
    """A record that was not turned into a Session: `reason` is a short key, `detail` says why."""

    source: str
    reason: str
    detail: str = ""


class _RecordError(Exception):
    def __init__(self, line: int, reason: str, detail: str):
        super().__init__(detail)
        self.line, self.reason, self.detail = line, reason, detail


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
    paths: Iterable[str | Path], *, strict: bool = False
) -> tuple[list[Session], list[Rejection]]:
    """Read every session under `paths`; bad records become Rejections (or DataError if `strict`)."""
    sessions: list[Session] = []
    rejections: list[Rejection] = []
    for path in find_jsonl(paths):
        for item in _read_file(path):
            if isinstance(item, Session):
                sessions.append(item)
            elif strict:
                raise DataError(f"{item.source}: {item.reason}: {item.detail}")
            else:
                rejections.append(item)
    return sessions, rejections


def _read_file(path: Path) -> Iterator[Session | Rejection]:
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        is_pi = json.loads(first).get("type") == "session"
    except (json.JSONDecodeError, AttributeError):
        is_pi = False
    if is_pi:
        try:
            yield _pi_session(path, lines)
        except _RecordError as r:
            yield Rejection(f"{path}:{r.line}", r.reason, r.detail)
        return
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield _openai_record(path, i, line)
        except _RecordError as r:
            yield Rejection(f"{path}:{r.line}", r.reason, r.detail)


# ---------------------------------------------------------------------------------------------
# Pi session files


def _pi_session(path: Path, lines: list[str]) -> Session:
    entries: list[tuple[int, dict]] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _RecordError(i, "invalid_json", f"undecodable JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or "type" not in obj:
            raise _RecordError(i, "missing_field", "entry is not an object with a 'type'")
        entries.append((i, obj))
    header_line, header = entries[0]
    if header.get("version") != 3:
        raise _RecordError(
            header_line, "unsupported_version", f"session version {header.get('version')!r}, not 3"
        )
    body = entries[1:]
    if not body:
        raise _RecordError(header_line, "empty_session", "header without entries")
    by_id: dict[str, tuple[int, dict]] = {}
    for ln, e in body:
        if "id" not in e or "parentId" not in e:
            raise _RecordError(ln, "missing_field", f"{e['type']} entry without 'id'/'parentId'")
        by_id[e["id"]] = (ln, e)
    path_entries: list[tuple[int, dict]] = []
    cur: tuple[int, dict] | None = body[-1]
    while cur is not None:
        path_entries.append(cur)
        parent = cur[1]["parentId"]
        if parent is not None and parent not in by_id:
            raise _RecordError(cur[0], "missing_field", f"parentId {parent!r} names no entry")
        cur = by_id[parent] if parent is not None else None
        if len(path_entries) > len(body):
            raise _RecordError(body[-1][0], "cycle", "parentId links form a cycle")
    path_entries.reverse()

    meta: dict[str, Any] = {}
    compaction_at = None
    for k, (_, e) in enumerate(path_entries):
        if e["type"] == "thinking_level_change":
            meta["effort"] = e.get("thinkingLevel")
        elif e["type"] == "compaction":
            compaction_at = k
        elif e["type"] == "custom" and e.get("customType") == ATTEMPT_TYPE:
            data = e.get("data") or {}
            meta.update({k2: data[k2] for k2 in ("task_id", "verified", "effort") if k2 in data})
    sidecar = path.with_name(path.name + ".meta.json")
    if sidecar.exists():
        meta.update(json.loads(sidecar.read_text(encoding="utf-8")))

    context = path_entries
    messages: list[dict] = []
    if compaction_at is not None:
        ln, comp = path_entries[compaction_at]
        _need(comp, ("summary", "firstKeptEntryId"), ln)
        messages.append({"role": "user", "content": COMPACTION_PREFIX + comp["summary"] + COMPACTION_SUFFIX})
        before = path_entries[:compaction_at]
        ids = [e["id"] for _, e in before]
        kept = before[ids.index(comp["firstKeptEntryId"]) :] if comp["firstKeptEntryId"] in ids else []
        context = kept + path_entries[compaction_at + 1 :]
    for ln, e in context:
        messages += _pi_entry_messages(ln, e)
    return Session(messages=messages, tools=None, meta=_meta(str(path), meta, ln=header_line))


def _need(obj: dict, keys: tuple[str, ...], line: int) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise _RecordError(line, "missing_field", f"missing {', '.join(map(repr, missing))}")


def _pi_text(content: Any, line: int) -> str:
    """User/custom/toolResult content: a string or text blocks; images cannot be trained on here."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _RecordError(line, "missing_field", "content is neither a string nor a list of blocks")
    parts = []
    for b in content:
        if b.get("type") == "image":
            raise _RecordError(line, "image_content", "image blocks are not supported")
        if b.get("type") != "text" or "text" not in b:
            raise _RecordError(line, "missing_field", f"unexpected content block {b.get('type')!r}")
        parts.append(b["text"])
    return "\n".join(parts)


def _pi_entry_messages(line: int, e: dict) -> list[dict]:
    kind = e["type"]
    if kind == "custom_message":
        _need(e, ("content",), line)
        return [{"role": "user", "content": _pi_text(e["content"], line)}]
    if kind == "branch_summary":
        return (
            [{"role": "user", "content": BRANCH_PREFIX + e["summary"] + BRANCH_SUFFIX}]
            if e.get("summary")
            else []
        )
    if kind != "message":
        return []  # custom, label, session_info, model_change, thinking_level_change: no context
    _need(e, ("message",), line)
    m = e["message"]
    role = m.get("role")
    if role == "user":
        _need(m, ("content",), line)
        return [{"role": "user", "content": _pi_text(m["content"], line)}]
    if role == "assistant":
        return [_pi_assistant(m, line)]
    if role == "toolResult":
        _need(m, ("toolCallId", "content"), line)
        return [
            {
                "role": "tool",
                "tool_call_id": m["toolCallId"],
                "name": m.get("toolName", ""),
                "content": _pi_text(m["content"], line),
            }
        ]
    if role == "bashExecution":
        # `!cmd` runs by the user reach the model as a user message (Pi's bashExecutionToText).
        if m.get("excludeFromContext"):
            return []
        text = f"Ran `{m.get('command', '')}`\n" + (
            f"```\n{m['output']}\n```" if m.get("output") else "(no output)"
        )
        if m.get("cancelled"):
            text += "\n\n(command cancelled)"
        elif m.get("exitCode") not in (None, 0):
            text += f"\n\nCommand exited with code {m['exitCode']}"
        if m.get("truncated") and m.get("fullOutputPath"):
            text += f"\n\n[Output truncated. Full output: {m['fullOutputPath']}]"
        return [{"role": "user", "content": text}]
    if role in ("custom", "branchSummary", "compactionSummary"):
        return [{"role": "user", "content": _pi_text(m.get("content", m.get("summary", "")), line)}]
    raise _RecordError(line, "missing_field", f"unknown message role {role!r}")


def _pi_assistant(m: dict, line: int) -> dict:
    _need(m, ("content",), line)
    if m.get("stopReason") in _BAD_STOPS:
        raise _RecordError(line, "assistant_error", f"assistant turn stopped with {m['stopReason']!r}")
    thinking, text, calls = [], [], []
    for b in m["content"]:
        t = b.get("type")
        if t == "thinking":
            thinking.append(b.get("thinking", ""))
        elif t == "text":
            text.append(b.get("text", ""))
        elif t == "toolCall":
            _need(b, ("id", "name", "arguments"), line)
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": b["arguments"]},
                }
            )
        elif t == "image":
            raise _RecordError(line, "image_content", "image blocks are not supported")
        else:
            raise _RecordError(line, "missing_field", f"unexpected assistant block {t!r}")
    out: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(x for x in text if x)}
    reasoning = "\n\n".join(x for x in thinking if x)
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


def _meta(source: str, meta: dict, ln: int) -> SessionMeta:
    verified = meta.get("verified")
    if verified is not None and not isinstance(verified, bool):
        raise _RecordError(ln, "missing_field", f"meta 'verified' must be a boolean, not {verified!r}")
    effort, task = meta.get("effort"), meta.get("task_id")
    return SessionMeta(
        source=source,
        effort=None if effort is None else str(effort),
        verified=verified,
        task_id=None if task is None else str(task),
    )


# ---------------------------------------------------------------------------------------------
# OpenAI-style records


def _openai_record(path: Path, line: int, text: str) -> Session:
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise _RecordError(line, "invalid_json", f"undecodable JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
        raise _RecordError(line, "missing_field", "record has no 'messages' list")
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _RecordError(line, "missing_field", "'tools' must be a list")
    messages = [_openai_message(m, line) for m in rec["messages"]]
    return Session(messages=messages, tools=tools, meta=_meta(f"{path}:{line}", rec.get("meta") or {}, line))


def _openai_message(m: Any, line: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise _RecordError(line, "missing_field", f"message without a known role: {str(m)[:60]}")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts
        if any(p.get("type") not in ("text", None) for p in content):
            raise _RecordError(line, "image_content", "non-text content parts are not supported")
        content = "".join(p.get("text", "") for p in content)
    out: dict[str, Any] = {"role": m["role"], "content": content or ""}
    if m["role"] == "tool":
        if "tool_call_id" not in m:
            raise _RecordError(line, "missing_field", "tool message without 'tool_call_id'")
        out["tool_call_id"] = m["tool_call_id"]
        if "name" in m:
            out["name"] = m["name"]
    if m["role"] == "assistant":
        if m.get("reasoning_content"):
            out["reasoning_content"] = m["reasoning_content"]
        calls = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or "name" not in fn:
                raise _RecordError(line, "missing_field", "tool call without function.name")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise _RecordError(
                        line, "bad_arguments", f"tool call arguments are not JSON: {args[:60]!r}"
                    ) from None
            calls.append(
                {
                    "id": c.get("id", ""),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args},
                }
            )
        if calls:
            out["tool_calls"] = calls
    return out
