"""Admission gates: every reason has a crafted witness, counts are right, the demo set is as intended."""

from __future__ import annotations

import json

import pytest

from jaxpi.data import (
    DEMO_DATA,
    TINY_TOKENIZER,
    GateConfig,
    RenderConfig,
    admit,
    build_examples,
    read_sessions,
)
from jaxpi.data.gates import structure_faults
from jaxpi.data.sessions import Session, SessionMeta
from jaxpi.data.tools import pi_tools, tool_schemas, validate


def _call(name: str, args: dict, cid: str = "c1") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _session(messages: list[dict], source: str = "s", tools=None, **meta) -> Session:
    meta = {"verified": True, "effort": "low", "task_id": "t", **meta}
    return Session(messages=messages, tools=tools, meta=SessionMeta(source=source, **meta))


def _good(source: str = "good", **meta) -> Session:
    return _session(
        [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "use ls",
                "tool_calls": [_call("bash", {"command": "ls"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
            {"role": "assistant", "content": "There is a.py."},
        ],
        source,
        **meta,
    )


def _with_call(call: dict, source: str) -> Session:
    return _session(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
            {"role": "assistant", "content": "done"},
        ],
        source,
    )


U = {"role": "user", "content": "go"}
DONE = {"role": "assistant", "content": "done"}
CRAFTED: dict[str, Session] = {
    "unknown_tool": _with_call(_call("grep", {"pattern": "x"}), "unknown_tool"),
    "bad_arguments": _with_call(_call("read", {"file": "a.py"}), "bad_arguments"),
    "call_without_result": _session(
        [U, {"role": "assistant", "content": "", "tool_calls": [_call("bash", {"command": "ls"})]}, DONE],
        "call_without_result",
    ),
    "result_without_call": _session(
        [U, {"role": "tool", "tool_call_id": "zz", "content": "?"}, DONE], "result_without_call"
    ),
    "empty_assistant_turn": _session(
        [U, {"role": "assistant", "content": "  "}, U, DONE], "empty_assistant_turn"
    ),
    "not_ending_with_assistant": _session([U, DONE, U], "not_ending_with_assistant"),
    "verifier_failed": _good("verifier_failed", verified=False),
    "verifier_unknown": _good("verifier_unknown", verified=None),
    "effort_not_allowed": _good("effort_not_allowed", effort="xhigh"),
    "effort_unknown": _good("effort_unknown", effort=None),
    "too_few_turns": _session([U, DONE], "too_few_turns"),
    "too_many_turns": _session([U, DONE, U, DONE, U, DONE, U, DONE], "too_many_turns"),
}
POLICY = GateConfig(allowed_efforts=("low", "medium", "high"), min_assistant_turns=2, max_assistant_turns=3)


def test_each_reason_is_triggered_and_counted():
    sessions = [_good("good1"), *CRAFTED.values(), _good("good2")]
    admitted, report = admit(sessions, POLICY)
    assert [s.meta.source for s in admitted] == ["good1", "good2"]
    assert report.total == len(sessions) and report.admitted == 2
    # the crafted witnesses of too_few/too_many turns also fail nothing else; check each reason's sources
    by_reason: dict[str, set[str]] = {}
    for r in report.excluded:
        by_reason.setdefault(r.reason, set()).add(r.source)
    for reason in CRAFTED:
        assert reason in by_reason[reason], (reason, by_reason.get(reason))
    assert dict(report.reasons) == {k: len(v) for k, v in by_reason.items()}
    assert {r.source for r in report.excluded} == set(CRAFTED)
    d = report.to_dict()
    json.dumps(d)
    assert d["excluded_sessions"] == len(CRAFTED) and d["admitted"] == 2


def test_counts_add_up_over_repeats():
    _, report = admit([CRAFTED["unknown_tool"]] * 3 + [CRAFTED["verifier_failed"]] * 2)
    assert report.reasons["unknown_tool"] == 3 and report.reasons["verifier_failed"] == 2


def test_policy_switches():
    unverified = CRAFTED["verifier_failed"]
    assert admit([unverified], GateConfig(require_verified=False))[1].admitted == 1
    assert admit([CRAFTED["effort_unknown"]])[1].admitted == 1  # any effort by default


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"file": "a"}, "missing required key 'path'"),
        ({"path": "a", "file": "b"}, "unknown key 'file'"),
        ({"path": 3}, "read.arguments.path: expected string"),
        ({"path": "a", "offset": "3"}, "offset: expected number"),
        ({"path": "a", "limit": True}, "limit: expected number"),  # bool is not a JSON number
    ],
)
def test_read_argument_errors(args, fragment):
    errors = validate(tool_schemas(None)["read"], args, "read.arguments")
    assert any(fragment in e for e in errors), errors


def test_edit_schema_nested():
    schema = tool_schemas(None)["edit"]
    ok = {"path": "a", "edits": [{"oldText": "x", "newText": "y"}]}
    assert validate(schema, ok) == []
    assert validate(schema, {"path": "a", "edits": {"oldText": "x"}}) == [
        "arguments.edits: expected array, got dict"
    ]
    errs = validate(schema, {"path": "a", "edits": [{"oldText": "x", "newText": 1, "extra": 0}]})
    assert sorted(errs) == sorted(
        ["arguments.edits[0]: unknown key 'extra'", "arguments.edits[0].newText: expected string, got int"]
    )
    assert validate(tool_schemas(None)["bash"], {"command": "ls", "timeout": 2.5}) == []
    with pytest.raises(ValueError, match="unsupported"):
        validate({"type": "string", "enum": ["a"]}, "a")


def test_session_tool_list_overrides_pi_tools():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "grep",
                "parameters": {
                    "type": "object",
                    "properties": {"pattern": {"type": "string"}},
                    "required": ["pattern"],
                },
            },
        }
    ]
    s = _with_call(_call("grep", {"pattern": "x"}), "own-tools")
    assert structure_faults(Session(s.messages, tools, s.meta)) == {}
    s2 = _with_call(_call("bash", {"command": "ls"}), "not-listed")
    assert "unknown_tool" in structure_faults(Session(s2.messages, tools, s2.meta))
    assert [t["function"]["name"] for t in pi_tools()] == ["read", "bash", "edit", "write"]


def test_gate_config_is_validated():
    with pytest.raises(ValueError, match="max_assistant_turns"):
        GateConfig(min_assistant_turns=3, max_assistant_turns=2)
    with pytest.raises(ValueError, match="max_tokens"):
        GateConfig(max_tokens=0)
    with pytest.raises(ValueError, match="allowed_efforts"):
        GateConfig(allowed_efforts=())
    assert GateConfig(allowed_efforts=["low"]).allowed_efforts == ("low",)


def test_demo_fixtures_admitted_as_intended():
    manifest = json.loads((DEMO_DATA / "manifest.json").read_text())
    sessions, rejections = read_sessions([DEMO_DATA])
    admitted, report = admit(sessions, GateConfig(), rejections)
    want_admitted = {k for k, v in manifest.items() if v["admitted"]}

    def rel(source: str) -> str:
        path = source.split(str(DEMO_DATA) + "/", 1)[1]
        return path if path.startswith("openai/") else path.rsplit(".jsonl", 1)[0] + ".jsonl"

    assert {rel(s.meta.source) for s in admitted} == want_admitted
    assert report.admitted == len(want_admitted) == 30
    got: dict[str, set[str]] = {}
    for r in report.excluded:
        got.setdefault(rel(r.source), set()).add(r.reason)
    assert got == {k: set(v["reasons"]) for k, v in manifest.items() if not v["admitted"]}
    assert report.total == len(manifest)


def test_max_tokens_is_checked_after_rendering():
    render = RenderConfig(TINY_TOKENIZER)
    paths = [DEMO_DATA / "sessions" / "000_plain.jsonl", DEMO_DATA / "sessions" / "004_follow_up.jsonl"]
    examples, report = build_examples(paths, render)
    longest = {e.source: 0 for e in examples}
    for e in examples:
        longest[e.source] = max(longest[e.source], e.num_tokens)
    limit = min(longest.values())  # admits the shorter session, not the longer one
    examples2, report2 = build_examples(paths, render, GateConfig(max_tokens=limit))
    assert report.admitted == 2 and report2.admitted == 1
    assert report2.reasons == {"too_many_tokens": 1}
    assert {e.source for e in examples2} == {min(longest, key=longest.get)}
    assert all(e.num_tokens <= limit for e in examples2)
