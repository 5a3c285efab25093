"""Admission gates: which sessions are fit to train on, and a report of why the others are not.

Structure checks always apply (a malformed session teaches the model malformed behaviour):
unknown tool names, arguments that break the tool's schema, a tool call without a result, a result
without a call, an empty assistant turn, a conversation that does not end with the assistant.
`GateConfig` adds policy: the verifier must have passed, the effort level must be allowed, the
number of assistant turns and (after rendering) the token count must be in range.

A fault in the conversation is reported at the `file:line` its message was read from (an OpenAI
record is one line; its detail then says which message); policy faults name the session.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxpi.data.sessions import Rejection, Session
from jaxpi.data.tools import tool_schemas, validate

PI_EFFORTS: tuple[str, ...] = ("off", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class GateConfig:
    """Admission policy. `allowed_efforts=None` admits any level (unknown included)."""

    require_verified: bool = True
    allowed_efforts: tuple[str, ...] | None = None
    min_assistant_turns: int = 1
    max_assistant_turns: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.allowed_efforts is not None:
            object.__setattr__(self, "allowed_efforts", tuple(self.allowed_efforts))
            if not self.allowed_efforts:
                raise ValueError("allowed_efforts must name at least one level (or be None for any)")
        if self.min_assistant_turns < 0:
            raise ValueError(f"min_assistant_turns must be >= 0, not {self.min_assistant_turns}")
        if self.max_assistant_turns is not None and self.max_assistant_turns < max(
            1, self.min_assistant_turns
        ):
            raise ValueError(
                f"max_assistant_turns ({self.max_assistant_turns}) must be >= min_assistant_turns and >= 1"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, not {self.max_tokens}")


@dataclass
class GateReport:
    """Counts per reason (a session with several faults counts under each) and every exclusion."""

    total: int = 0
    admitted: int = 0
    reasons: Counter = field(default_factory=Counter)
    excluded: list[Rejection] = field(default_factory=list)

    def exclude(self, source: str, reasons: dict[str, str], where: dict[str, str] | None = None) -> None:
        """Record one excluded session (`source`) with its reasons (reason -> detail); `where`
        maps a reason to the `file:line` it was found at, when that is more precise than `source`."""
        where = where or {}
        self.reasons.update(reasons.keys())
        self.excluded += [Rejection(where.get(r, source), r, d, session=source) for r, d in reasons.items()]

    def add_read_rejections(self, rejections: Iterable[Rejection]) -> None:
        """Count records that never became sessions (undecodable lines, images, ...)."""
        for r in rejections:
            self.total += 1
            self.reasons[r.reason] += 1
            self.excluded.append(Rejection(r.source, r.reason, r.detail, session=r.session or r.source))

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            "admitted": self.admitted,
            "excluded_sessions": len({r.session or r.source for r in self.excluded}),
            "reasons": dict(sorted(self.reasons.items())),
            "excluded": [
                {"source": r.source, "reason": r.reason, "detail": r.detail, "session": r.session or r.source}
                for r in self.excluded
            ],
        }

    def table(self) -> str:
        lines = [f"sessions: {self.total}  admitted: {self.admitted}"]
        lines += [f"  {reason:<24} {n}" for reason, n in sorted(self.reasons.items())]
        lines += [f"  - {r.source}: {r.reason}: {r.detail}" for r in self.excluded]
        return "\n".join(lines)


def structure_faults(session: Session) -> dict[str, str]:
    """Faults in the conversation itself, reason -> first detail; empty when well formed."""
    return {reason: detail for reason, (_, detail) in _structure_faults(session).items()}


def _structure_faults(session: Session) -> dict[str, tuple[int, str]]:
    """reason -> (index of the message at fault, detail) of each reason's first fault."""
    faults: dict[str, tuple[int, str]] = {}

    def add(reason: str, i: int, detail: str) -> None:
        faults.setdefault(reason, (i, detail))

    msgs = session.messages
    try:
        schemas = tool_schemas(session.tools)
    except ValueError as e:
        add("bad_tool_schema", 0, f"the tool list is malformed: {e}")
        return faults
    # Calls must be answered before the conversation moves on: Pi runs every call of a turn and
    # appends its results right after it, so anything else is a broken or hand-edited log.
    open_calls: dict[str, str] = {}  # tool_call_id -> tool name, awaiting a result
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "assistant":
            if open_calls:
                add(
                    "call_without_result",
                    i,
                    f"message {i}: earlier call(s) {sorted(open_calls)} got no result",
                )
                open_calls.clear()
            calls = m.get("tool_calls") or []
            if (
                not (m.get("content") or "").strip()
                and not calls
                and not (m.get("reasoning_content") or "").strip()
            ):
                add("empty_assistant_turn", i, f"message {i}: no text, reasoning or tool call")
            # reasoning alone ends the turn without acting or answering: nothing useful to imitate
            elif not (m.get("content") or "").strip() and not calls:
                add("empty_assistant_turn", i, f"message {i}: reasoning only, no answer or tool call")
            for c in calls:
                name, args = c["function"]["name"], c["function"]["arguments"]
                if name not in schemas:
                    add("unknown_tool", i, f"message {i}: {name!r} is not one of {sorted(schemas)}")
                else:
                    try:
                        errors = validate(schemas[name], args, f"{name}.arguments")
                    except ValueError as e:  # the session's own tool schema is outside what we check
                        add("bad_tool_schema", i, f"message {i}: tool {name!r}: {e}")
                        errors = []
                    if errors:
                        add("bad_arguments", i, f"message {i}: " + "; ".join(errors))
                open_calls[c.get("id", "")] = name
        elif role == "tool":
            cid = m.get("tool_call_id")
            if cid not in open_calls:
                add("result_without_call", i, f"message {i}: tool_call_id {cid!r} answers no open call")
            open_calls.pop(cid, None)
        elif open_calls:
            add(
                "call_without_result",
                i,
                f"message {i}: {role} message before results of {sorted(open_calls)}",
            )
            open_calls.clear()
    if open_calls:
        add("call_without_result", len(msgs) - 1, f"end: call(s) {sorted(open_calls)} got no result")
    if not msgs or msgs[-1]["role"] != "assistant":
        add(
            "not_ending_with_assistant",
            len(msgs) - 1,
            f"last message is {msgs[-1]['role'] if msgs else 'absent'}",
        )
    return faults


def policy_faults(session: Session, cfg: GateConfig) -> dict[str, str]:
    """Faults against the admission policy (verifier, effort, turn count); empty when eligible."""
    faults: dict[str, str] = {}
    meta = session.meta
    if cfg.require_verified:
        if meta.verified is None:
            faults["verifier_unknown"] = "no verifier outcome recorded"
        elif not meta.verified:
            faults["verifier_failed"] = "verifier did not pass"
    if cfg.allowed_efforts is not None and meta.effort not in cfg.allowed_efforts:
        key = "effort_unknown" if meta.effort is None else "effort_not_allowed"
        faults[key] = f"effort {meta.effort!r} not in {list(cfg.allowed_efforts)}"
    turns = sum(m["role"] == "assistant" for m in session.messages)
    if turns < cfg.min_assistant_turns:
        faults["too_few_turns"] = f"{turns} assistant turns < {cfg.min_assistant_turns}"
    if cfg.max_assistant_turns is not None and turns > cfg.max_assistant_turns:
        faults["too_many_turns"] = f"{turns} assistant turns > {cfg.max_assistant_turns}"
    return faults


def admit(
    sessions: Iterable[Session], cfg: GateConfig | None = None, rejections: Iterable[Rejection] = ()
) -> tuple[list[Session], GateReport]:
    """Split sessions into admitted ones and a report; read-time `rejections` are counted too."""
    cfg = cfg or GateConfig()
    report = GateReport()
    report.add_read_rejections(rejections)
    admitted = []
    for s in sessions:
        report.total += 1
        located = _structure_faults(s)
        faults = {r: d for r, (_, d) in located.items()} | policy_faults(s, cfg)
        if faults:
            report.exclude(s.meta.source, faults, {r: s.location(i) for r, (i, _) in located.items()})
        else:
            admitted.append(s)
    report.admitted = len(admitted)
    return admitted, report
