"""What one Pi attempt produced (`AttemptRecord`) and what Pi's session file says about it (pure).

An attempt is *admitted* when it ran to an end the model is answerable for: a final answer (then
the verifier decides `success`) or one of our own limits on turns / output tokens (an admitted
failure: GRPO must see that the model ran out of room), or a last turn cut at the per-call token
cap ("length"; Pi takes the cut text as its answer). It is *not admitted*, with `reason`:

    timeout            the wall clock ran out (the sandbox was killed; the session may be cut short)
    sandbox_limit      the sandbox's memory / process / CPU limit ended Pi
    upstream_error     a model call failed (the server or gateway answered an error, or no answer)
    malformed_session  Pi left no readable session file, or one without an assistant turn
    verifier_error     the verifier itself could not run (killed at its limit, or not bash's exit)
    pi_error           Pi exited non-zero for any other reason
    worker_lost        the Ray worker running the attempt died, every try (`jaxpi.rl.fleet.pi`)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxpi.runner.events import aborted_before_call

NOT_ADMITTED = (
    "timeout",
    "sandbox_limit",
    "upstream_error",
    "malformed_session",
    "verifier_error",
    "pi_error",
    "worker_lost",
)
FINISHES = ("answer", "length", "max_turns", "max_tokens")


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    attempt_id: str
    task_id: str
    level: str
    admitted: bool
    success: bool
    reason: str | None  # one of NOT_ADMITTED when not admitted
    finish: str | None  # one of FINISHES when admitted
    turns: int  # assistant turns (model calls) in the session
    output_tokens: int  # sampled tokens over all calls
    reasoning_tokens: int  # of those, inside thinking blocks (from the gateway's trace when given)
    wall_seconds: float
    pi_returncode: int | None = None
    verifier_returncode: int | None = None
    detail: str = ""  # the first error line, the limit that was hit, ...
    session_path: str | None = None  # Pi's session file, copied out of the attempt's config home
    events_path: str | None = None  # Pi's --mode json event stream
    calls: tuple[dict, ...] = ()  # the gateway's records of this attempt's model calls
    # Tool calls Pi ran, by tool name (the session's toolCall blocks); {} when no session was read.
    tool_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    # Model calls: the gateway's records of the attempt when traced, else the session's assistant turns.
    model_calls: int = 0
    # Of the tool calls, those whose result Pi marked as an error, by tool (from the event stream).
    tool_errors: dict[str, int] = dataclasses.field(default_factory=dict)
    pi: str | None = None  # the Pi release that ran the attempt, "<package>@<version>"
    # What the attempt ran under, resolved (the task's limits where the runner left them to it):
    # temperature, top_p, seed of the first call, max_turns (= model calls: one per turn),
    # max_tokens, max_tokens_per_call, wall_seconds, context_window, tools.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.admitted and self.finish not in FINISHES:
            raise ValueError(f"attempt {self.attempt_id}: admitted with finish {self.finish!r}")
        if not self.admitted and self.reason not in NOT_ADMITTED:
            raise ValueError(f"attempt {self.attempt_id}: not admitted needs a reason in {NOT_ADMITTED}")
        if self.success and not self.admitted:
            raise ValueError(f"attempt {self.attempt_id}: a success must be admitted")

    def to_json(self, *, with_calls: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not with_calls:
            d.pop("calls")
        return d


@dataclasses.dataclass(frozen=True)
class SessionSummary:
    """The parts of a Pi session file the runner reads."""

    turns: int
    output_tokens: int
    error: str | None  # the errorMessage of an assistant turn that stopped with "error"
    limit: str | None  # "max_turns" / "max_tokens" from our limits extension's entry
    final_text: str | None  # the last assistant turn's text when it made no tool call
    tool_calls: int
    messages: int
    last_stop: str | None = None  # stopReason of the last assistant turn ("stop", "length", "toolUse", ...)
    tool_calls_by_name: dict[str, int] = dataclasses.field(default_factory=dict)  # sums to tool_calls


def read_session_summary(path: Path) -> SessionSummary:
    """Summarise a Pi v3 session file; ValueError (naming file and line) when it is not one."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty session file")
    entries = []
    for i, line in enumerate(lines, start=1):
        try:
            e = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: undecodable JSON ({err.msg})") from None
        if not isinstance(e, dict) or "type" not in e:
            raise ValueError(f"{path}:{i}: not an entry object with a 'type'")
        entries.append(e)
    # Version 3 is the format this reader (and jaxpi.data.sessions) knows; refuse anything else.
    if entries[0]["type"] != "session" or entries[0].get("version") != 3:
        raise ValueError(f"{path}:1: not a Pi v3 session header")
    turns = output = calls = messages = 0
    error = limit = final = last_stop = None
    by_name: dict[str, int] = {}
    for e in entries[1:]:
        # Written by the runner's Pi extension when it aborts the loop at a limit.
        if e["type"] == "custom" and e.get("customType") == "jaxpi.limit":
            limit = (e.get("data") or {}).get("reason")
        if e["type"] != "message" or not isinstance(e.get("message"), dict):
            continue
        m = e["message"]
        messages += 1
        # Not a turn: the empty one Pi runs after the extension aborts at a limit (no call was made).
        if m.get("role") != "assistant" or aborted_before_call(m):
            continue
        turns += 1
        usage = m.get("usage") or {}
        output += int(usage.get("output") or 0)
        last_stop = m.get("stopReason")
        if m.get("stopReason") == "error":
            error = str(m.get("errorMessage") or "model call failed")
        blocks = m.get("content") or []
        tool_blocks = [b for b in blocks if isinstance(b, dict) and b.get("type") == "toolCall"]
        n_calls = len(tool_blocks)
        calls += n_calls
        for b in tool_blocks:
            name = str(b.get("name") or "?")  # a call without a name still ran (or failed) as a call
            by_name[name] = by_name.get(name, 0) + 1
        text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        # Only a turn without tool calls is an answer; a later tool turn takes it back.
        final = text if n_calls == 0 else None
    return SessionSummary(turns, output, error, limit, final, calls, messages, last_stop, by_name)
