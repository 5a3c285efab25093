"""Pi session files, as Pi 0.73 and Pi 1.x write them, read into one `Session` each.

A Pi file (JSONL, `"version": 3` in both releases; `docs/session-format.md` of either package) is
a header `{"type": "session", ...}` then entries linked by `id`/`parentId`. We build what Pi itself
would send the model at the file's active leaf (1.6.0's `buildSessionContext`,
`dist/core/session-manager.js`, which extends 0.73's):

1. the active leaf is the last entry in file order; the path is leaf -> root via `parentId`, reversed;
2. with a `compaction` on the path, the context is the latest one (its `systemMessage` (1.x), then
   its summary as a user message in Pi's preamble), the entries from its `firstKeptEntryId` up to
   it (system messages among them dropped: the checkpoint replaces them) and every entry after it;
3. a `context_edit` (1.x) replaces its target's content in the context (`replacement: null` omits
   the target), the latest edit of a target winning; edits whose target left the context are inert;
4. `message` entries give their message; `custom_message` and `branch_summary` user-side context
   (the branch summary in Pi's `<summary>` preamble); `custom`, `label`, `session_info`,
   `model_change`, `thinking_level_change`, `usage` (1.x) and `context_edit` give none;
5. 1.x `system` messages hold the prompt and the tool declarations: the first has every prompt
   section, later ones patch sections by name (null removes one) and add or remove tools. Pi
   replays them into one leading system message (`collapseSystemMessages`: what it sends a server
   that takes no mid-conversation system message, as jaxpi's provider config says): the contents,
   then the sections in their order, joined by blank lines; the tools become the session's OpenAI
   tool schemas (`Session.tools`), so a 1.x session renders with exactly the prompt and tools the
   model was given. A 0.73 file records neither (`Session.tools` is None: the renderer's defaults).

Message roles: user, assistant, toolResult, bashExecution (a `!cmd` the user ran: a user message,
Pi's `bashExecutionToText`), custom, branchSummary, compactionSummary and 1.x's system.

Nothing is dropped silently. An entry type neither release writes is `unknown_entry`, an unknown
role or content block `bad_field`. Where no single rendering is what every turn saw, the session is
rejected with the reason, never rendered differently:
- `system_changed`: a system message after an assistant turn changes the prompt or the tools (a
  session resumed under another release, a tool loadout changed mid-session): earlier turns were
  sampled under another prompt;
- `context_edit`: an edit of an assistant turn (its supervised text would not be what the model
  produced), of an entry after the edit, or with an assistant turn between target and edit (that
  turn saw the original); `unknown_target` for an edit whose target is in no line of the file;
- `mixed_effort`: assistant turns that record different thinking levels (1.x records each
  response's level; a session renders at one level).

Metadata (effort, verifier outcome, task id), later sources winning: the last
`thinking_level_change` on the path; the level the assistant turns record (1.x); the last `custom`
entry with `customType: "jaxpi.attempt"` and `data: {"task_id", "verified", "effort"}` (any key may
be missing), which the rollout harness appends once the verifier has run; a sidecar
`<file>.meta.json` with the same keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpi.data.schema import (
    AttemptMeta,
    Block,
    PiAssistant,
    PiBashExecution,
    PiBranchSummary,
    PiCompaction,
    PiContextEdit,
    PiCustom,
    PiCustomMessage,
    PiEntry,
    PiHeader,
    PiMessageEntry,
    PiReplacement,
    PiSummaryMessage,
    PiSystem,
    PiThinkingLevel,
    PiToolDecl,
    PiToolName,
    PiToolResult,
    PiUser,
    Role,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    _need_dict,
    _RecordError,
    _typed,
)
from jaxpi.data.session_types import ReadLimits, Rejection, Session, SessionMeta, _Line, _parse

# Pi's context preambles (dist/core/messages.js, the same in 0.73 and 1.6), so summaries read as
# the model saw them.
COMPACTION_PREFIX = (
    "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
)
COMPACTION_SUFFIX = "\n</summary>"
BRANCH_PREFIX = "The following is a summary of a branch that this conversation came back from:\n\n<summary>\n"
BRANCH_SUFFIX = "</summary>"
ATTEMPT_TYPE = "jaxpi.attempt"
# What pi-ai sends for a tool result without text. (A tool call left without a result, which pi-ai
# answers with "No result provided", is left as it is: the gates refuse it, call_without_result.)
NO_OUTPUT = "(no tool output)"
# A turn cut by the length limit never produced its end-of-turn token; errors, aborts and 1.x's
# deferred or still-streaming responses are not behaviour.
_BAD_STOPS = ("error", "aborted", "length", "deferred", "pending")
# Entry types that give no context message (1.x adds `usage`; `context_edit` acts on another entry).
_NO_CONTEXT = (
    "custom",
    "label",
    "session_info",
    "model_change",
    "thinking_level_change",
    "usage",
    "context_edit",
)
_ENTRY_MODELS: dict[str, type[PiEntry]] = {
    "thinking_level_change": PiThinkingLevel,
    "compaction": PiCompaction,
    "branch_summary": PiBranchSummary,
    "custom_message": PiCustomMessage,
    "custom": PiCustom,
    "message": PiMessageEntry,
    "context_edit": PiContextEdit,
}
# Roles whose content a context edit replaces (Pi's projectContextEntry); null omits any entry.
_EDITABLE_ROLES = ("user", "toolResult", "custom")


def pi_file(path: Path, lines: Iterator[_Line], limits: ReadLimits) -> Session | Rejection:
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
    model = _ENTRY_MODELS.get(base.type)
    if model is None:
        if base.type in _NO_CONTEXT:
            return base
        raise _RecordError(
            line, "unknown_entry", f"entry type {base.type!r} is not one Pi 0.73 or 1.x writes"
        )
    return _typed(model, obj, line)


def _role(e: PiEntry, line: int) -> str | None:
    """The message role of a `message` entry (None for other entries)."""
    return _typed(Role, e.message, line, "message").role if isinstance(e, PiMessageEntry) else None


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
    for _, e in path_entries:
        if isinstance(e, PiThinkingLevel):
            meta["effort"] = e.thinkingLevel
    context = _context_entries(path_entries)
    edits = _edits(context, by_id)
    built = _Built()
    for k, (ln, e) in enumerate(context):
        built.add(ln, e, edits.get(e.id), leading=k == 0)
    if built.effort is not None:
        meta["effort"] = built.effort
    for ln, e in path_entries:
        if isinstance(e, PiCustom) and e.customType == ATTEMPT_TYPE:
            data = _typed(AttemptMeta, {} if e.data is None else e.data, ln, "data")
            meta.update(data.model_dump(include=data.model_fields_set))
    messages, where = built.messages, built.where
    if built.system is not None:
        messages = [{"role": "system", "content": built.system.text()}, *messages]
        where = [built.system.line, *where]
    if not built.messages:
        raise _RecordError(
            path_entries[-1][0], "empty_session", "the active branch (its leaf is here) holds no messages"
        )
    sidecar = _sidecar(path)
    if sidecar is not None:
        meta.update(sidecar)
    return Session(
        messages=messages,
        tools=None if built.system is None else built.system.openai_tools(),
        meta=SessionMeta(source=str(path), **meta),
        locations=tuple(f"{path}:{ln}" for ln in where),
    )


def _context_entries(path: list[tuple[int, PiEntry]]) -> list[tuple[int, PiEntry]]:
    """Pi's `buildContextEntries`: the path, or the latest compaction, what it keeps and what follows."""
    at = max((k for k, (_, e) in enumerate(path) if isinstance(e, PiCompaction)), default=None)
    if at is None:
        return path
    comp = path[at][1]
    assert isinstance(comp, PiCompaction)
    kept, found = [], False
    for ln, e in path[:at]:
        found = found or e.id == comp.firstKeptEntryId
        if found and _role(e, ln) != "system":
            kept.append((ln, e))
    return [path[at], *kept, *path[at + 1 :]]


def _edits(
    context: list[tuple[int, PiEntry]], by_id: dict[str, tuple[int, PiEntry]]
) -> dict[str, PiContextEdit]:
    """target id -> the latest `context_edit` of it in the context, checked to be renderable."""
    index = {e.id: k for k, (_, e) in enumerate(context)}
    latest: dict[str, tuple[int, int, PiContextEdit]] = {}
    for k, (ln, e) in enumerate(context):
        if isinstance(e, PiContextEdit):
            if e.targetId not in by_id:
                raise _RecordError(ln, "unknown_target", f"targetId {e.targetId!r} names no entry")
            latest[e.targetId] = (k, ln, e)
    out = {}
    for target, (k, ln, edit) in latest.items():
        t = index.get(target)
        if t is None:
            continue  # the target was compacted away: the edit changes nothing the model sees
        t_line, t_entry = context[t]
        if t > k:
            raise _RecordError(ln, "context_edit", f"edits line {t_line}, which comes after it")
        if _role(t_entry, t_line) == "assistant":
            raise _RecordError(
                ln,
                "context_edit",
                f"edits the assistant turn on line {t_line}: its text is what the model produced",
            )
        between = [
            context[j][0] for j in range(t + 1, k) if _role(context[j][1], context[j][0]) == "assistant"
        ]
        if between:
            raise _RecordError(
                ln,
                "context_edit",
                f"edits line {t_line}, but the assistant turn on line {between[0]} saw it unedited",
            )
        if edit.replacement is not None:
            _typed(PiReplacement, edit.replacement, ln, "replacement")
        out[target] = edit
    return out


@dataclass
class _System:
    """1.x system messages replayed as Pi's `getCurrentSystemMessage` does."""

    line: int
    contents: list[str] = field(default_factory=list)
    sections: dict[str, str] = field(default_factory=dict)
    tools: dict[str, PiToolDecl] = field(default_factory=dict)

    def apply(self, m: PiSystem, line: int) -> None:
        text = _pi_text(m.content, line, "message.content")
        if text:
            self.contents.append(text)
        for name, value in (m.sections or {}).items():
            if value is None:
                self.sections.pop(name, None)
            else:
                self.sections[name] = value
        for i, t in enumerate(m.toolsRemoved or []):
            self.tools.pop(_typed(PiToolName, t, line, f"message.toolsRemoved[{i}]").name, None)
        for i, t in enumerate(m.toolsAdded or []):
            decl = _typed(PiToolDecl, t, line, f"message.toolsAdded[{i}]")
            self.tools[decl.name] = decl

    def text(self) -> str:
        """Pi's `getSystemMessageText` of the replayed message."""
        parts = ["\n\n".join(self.contents), *self.sections.values()]
        return "\n\n".join(p for p in parts if p)

    def openai_tools(self) -> list[dict]:
        """The tools as pi-ai's openai-completions provider sends them (`strict` off, jaxpi's compat)."""
        out = []
        for t in self.tools.values():
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = t.parameters
            out.append({"type": "function", "function": fn})
        return out

    def state(self) -> tuple[str, list[dict]]:
        return self.text(), self.openai_tools()


@dataclass
class _Built:
    """The context's messages, built entry by entry with the checks of the module docstring."""

    messages: list[dict] = field(default_factory=list)
    where: list[int] = field(default_factory=list)
    system: _System | None = None
    effort: str | None = None
    effort_line: int = 0
    seen_assistant: bool = False

    def add(self, line: int, e: PiEntry, edit: PiContextEdit | None, *, leading: bool = False) -> None:
        if isinstance(e, PiCompaction):
            # Only the latest compaction, which leads the context, contributes; an older one kept
            # in its range (its entry lies after the kept start) gives nothing.
            if leading:
                if e.systemMessage is not None:
                    self._system(_typed(PiSystem, e.systemMessage, line, "systemMessage"), line)
                self._emit(
                    line, {"role": "user", "content": COMPACTION_PREFIX + e.summary + COMPACTION_SUFFIX}
                )
            return
        if edit is not None and edit.replacement is None:
            return  # omitted from the model's context by a context_edit
        if isinstance(e, PiMessageEntry) and _role(e, line) == "system":
            self._system(_typed(PiSystem, e.message, line, "message"), line)
            return
        replaced = None if edit is None else PiReplacement.model_validate(edit.replacement).content
        for m in _pi_entry_messages(line, e, replaced):
            if m["role"] == "assistant":  # a turn pi-ai sends (an empty one is not, nor rendered)
                self.seen_assistant = True
                self._level(_typed(PiAssistant, e.message, line, "message").thinkingLevel, line)
            self._emit(line, m)

    def _level(self, level: str | None, line: int) -> None:
        if level is None:
            return
        if self.effort is not None and level != self.effort:
            raise _RecordError(
                line,
                "mixed_effort",
                f"this assistant turn was requested at {level!r}, the one on line {self.effort_line} at {self.effort!r}",
            )
        self.effort, self.effort_line = level, line

    def _emit(self, line: int, m: dict) -> None:
        self.messages.append(m)
        self.where.append(line)

    def _system(self, m: PiSystem, line: int) -> None:
        if self.system is None:
            self.system = _System(line)
        before = self.system.state()
        self.system.apply(m, line)
        if self.seen_assistant and self.system.state() != before:
            raise _RecordError(
                line,
                "system_changed",
                "the system prompt or tools change here, after an assistant turn that was sampled under the earlier ones",
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


def _texts(content: Any, line: int, where: str) -> list[str]:
    """The texts of string-or-blocks content; images cannot be trained on here."""
    if isinstance(content, str):
        return [content]
    parts = []
    for i, b in enumerate(content):
        kind = _typed(Block, b, line, f"{where}[{i}]").type
        if kind == "image":
            raise _RecordError(line, "image_content", "image blocks are not supported")
        if kind != "text":
            raise _RecordError(line, "bad_field", f"{where}[{i}]: unexpected content block {kind!r}")
        parts.append(_typed(TextBlock, b, line, f"{where}[{i}]").text)
    return parts


def _pi_text(content: Any, line: int, where: str) -> str:
    """Text blocks joined by newlines (pi-ai's `contentText`): system and tool-result content."""
    return "\n".join(_texts(content, line, where))


def _user(content: Any, line: int, where: str, *, as_string: bool = False) -> list[dict]:
    """A user-side message as pi-ai sends it: a user's string as is; block content (and custom
    messages, summaries, `!cmd` runs, which Pi turns into blocks) without its empty texts, joined by
    newlines as the server joins the parts, and no message at all when nothing is left."""
    if as_string and isinstance(content, str):
        return [{"role": "user", "content": content}]
    texts = [t for t in _texts(content, line, where) if t]
    return [{"role": "user", "content": "\n".join(texts)}] if texts else []


def _pi_entry_messages(line: int, e: PiEntry, replaced: Any = None) -> list[dict]:
    """The context messages of one entry, as pi-ai's openai-completions provider sends them;
    `replaced` is a context edit's replacement content."""
    if isinstance(e, PiCustomMessage):
        return _user(e.content if replaced is None else replaced, line, "content")
    if isinstance(e, PiBranchSummary):
        return _user(BRANCH_PREFIX + e.summary + BRANCH_SUFFIX, line, "summary") if e.summary else []
    if not isinstance(e, PiMessageEntry):
        return []  # the entry types of _NO_CONTEXT
    m = e.message
    role = _typed(Role, m, line, "message").role
    if replaced is not None and role in _EDITABLE_ROLES:
        m = {**m, "content": replaced}
    if role == "user":
        return _user(_typed(PiUser, m, line, "message").content, line, "message.content", as_string=True)
    if role == "assistant":
        return _pi_assistant(_typed(PiAssistant, m, line, "message"), line)
    if role == "toolResult":
        r = _typed(PiToolResult, m, line, "message")
        text = _pi_text(r.content, line, "message.content")
        # pi-ai sends a placeholder for a result without text (and no `name`: jaxpi's compat)
        return [
            {"role": "tool", "tool_call_id": r.toolCallId, "content": text if text.strip() else NO_OUTPUT}
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
        return _user(text, line, "message")
    if role in ("custom", "branchSummary", "compactionSummary"):
        s = _typed(PiSummaryMessage, m, line, "message")
        if role == "custom":
            return _user(s.content if s.content is not None else "", line, "message.content")
        prefix, suffix = (
            (BRANCH_PREFIX, BRANCH_SUFFIX)
            if role == "branchSummary"
            else (COMPACTION_PREFIX, COMPACTION_SUFFIX)
        )
        return _user(prefix + (s.summary or "") + suffix, line, "message.summary")
    raise _RecordError(line, "bad_field", f"message.role: unknown message role {role!r}")


def _pi_assistant(m: PiAssistant, line: int) -> list[dict]:
    """One assistant turn as pi-ai sends it back: texts that are not blank joined as they are,
    reasoning from the thinking blocks that are not blank joined by newlines, the tool calls; a
    turn with neither text nor tool calls is not sent at all (so not trained on either)."""
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
    content = "".join(x for x in text if x.strip())
    if not content and not calls:
        return []
    out: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = "\n".join(x for x in thinking if x.strip())
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return [out]
