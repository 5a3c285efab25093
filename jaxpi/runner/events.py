"""Pi's `--mode json` event stream (the attempt's events.jsonl), read the same for Pi 0.73 and 1.x.

One JSON object per line, split on "\\n" only (Pi's docs/json.md: strings may hold U+2028 raw).
The first line is the session header; then `agent_start`, and per turn `turn_start`,
`message_start`/`message_update`/`message_end` (user, assistant, toolResult, and 1.x's system
message), `tool_execution_start`/`_update`/`_end`, `turn_end`; then `agent_end` and, in 1.x only,
`agent_settled` (`aborted`: the run ended by an abort). What changed in 1.x that a reader meets:
`message_update` carries only the delta (`assistantMessageEvent`, `usage`: the cumulative `message`
and `partial` are gone), the streaming assistant `message_start` says `stopReason: "pending"`,
and `entry_appended`, `agent_settled`, `summarization_retry_*` are new. This reader takes only what
both releases send whole: finished messages (`message_end`), finished tool runs
(`tool_execution_end`) and the end markers; an event type it does not know is counted, not an
error (Pi exits 0 whatever the run's outcome, so the stream and the session say how it went).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Stop after this much: a stream is the attempt's own output, bounded by its token budget.
MAX_EVENT_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class EventSummary:
    """What one attempt's event stream says (counts over the whole stream)."""

    events: int  # lines that were JSON objects with a "type"
    bad_lines: int  # lines that were not (cut by a kill, or not Pi's)
    unknown: dict[str, int]  # event types this reader does not know, with their counts
    model_calls: int  # finished assistant messages that made a call (not an abort's empty turn)
    tool_runs: dict[str, int]  # finished tool executions, by tool
    tool_errors: dict[str, int]  # of those, the ones Pi marked isError, by tool
    last_stop: str | None  # stopReason of the last finished assistant message
    error: str | None  # its errorMessage when it stopped with "error"
    ended: bool  # agent_end was seen: Pi ran its loop to the end (or to an abort)
    aborted: bool | None  # 1.x agent_settled.aborted; None when the release does not say (0.73)


KNOWN = frozenset(
    {
        "session",
        "agent_start",
        "agent_end",
        "agent_settled",
        "turn_start",
        "turn_end",
        "message_start",
        "message_update",
        "message_end",
        "tool_execution_start",
        "tool_execution_update",
        "tool_execution_end",
        "entry_appended",
        "queue_update",
        "compaction_start",
        "compaction_end",
        "auto_retry_start",
        "auto_retry_end",
        "session_info_changed",
        "thinking_level_changed",
        "summarization_retry_scheduled",
        "summarization_retry_attempt_start",
        "summarization_retry_finished",
    }
)


def read_events(path: str | Path) -> EventSummary:
    """Summarise an events.jsonl; never raises on its content (a missing file is an OSError)."""
    raw = Path(path).read_bytes()[:MAX_EVENT_BYTES]
    return summarize_events(raw)


def summarize_events(raw: bytes) -> EventSummary:
    events = bad = calls = 0
    unknown: dict[str, int] = {}
    runs: dict[str, int] = {}
    errors: dict[str, int] = {}
    last_stop = error = None
    ended, aborted = False, None
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            e = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            bad += 1
            continue
        if not isinstance(e, dict) or not isinstance(e.get("type"), str):
            bad += 1
            continue
        events += 1
        kind = e["type"]
        if kind not in KNOWN:
            unknown[kind] = unknown.get(kind, 0) + 1
        elif kind == "message_end":
            m = e.get("message")
            if isinstance(m, dict) and m.get("role") == "assistant":
                stop = m.get("stopReason")
                last_stop = stop if isinstance(stop, str) else None
                error = str(m.get("errorMessage") or "model call failed") if stop == "error" else None
                if not aborted_before_call(m):
                    calls += 1
        elif kind == "tool_execution_end":
            name = e.get("toolName") if isinstance(e.get("toolName"), str) else "?"
            runs[name] = runs.get(name, 0) + 1
            if e.get("isError") is True:
                errors[name] = errors.get(name, 0) + 1
        elif kind == "agent_end":
            ended = True
        elif kind == "agent_settled":
            aborted = e.get("aborted") is True
    return EventSummary(events, bad, unknown, calls, runs, errors, last_stop, error, ended, aborted)


def aborted_before_call(m: dict[str, Any]) -> bool:
    """Whether assistant message `m` is the empty turn Pi runs after an abort from `turn_end`
    (both releases; the runner's extension aborts so at a limit): no request was sent for it."""
    usage = m.get("usage") if isinstance(m.get("usage"), dict) else {}
    return m.get("stopReason") == "aborted" and not m.get("content") and not (usage or {}).get("output")
