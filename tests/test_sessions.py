"""Reading Pi v3 session files and OpenAI-style records into Sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxpi.data import DEMO_DATA, DataError, read_sessions
from jaxpi.data.sessions import BRANCH_PREFIX, COMPACTION_PREFIX

SESSIONS = DEMO_DATA / "sessions"


def _one(path: Path):
    sessions, rejections = read_sessions([path])
    assert not rejections, rejections
    assert len(sessions) == 1
    return sessions[0]


def _write(tmp_path: Path, name: str, entries: list[dict | str]) -> Path:
    p = tmp_path / name
    p.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return p


HEADER = {"type": "session", "version": 3, "id": "s1", "timestamp": "2026-01-01T00:00:00.000Z", "cwd": "/w"}


def _msg(eid: str, parent: str | None, message: dict) -> dict:
    return {"type": "message", "id": eid, "parentId": parent, "timestamp": "t", "message": message}


def _asst(text: str, *calls: dict) -> dict:
    blocks = [{"type": "text", "text": text}] + [{"type": "toolCall", **c} for c in calls]
    return {"role": "assistant", "content": blocks, "stopReason": "toolUse" if calls else "stop"}


def test_active_branch_is_the_path_to_the_last_entry(tmp_path):
    # u1 -> a1 (first branch), u1 -> a2 (second branch), then a custom entry hung on a1: the leaf is
    # the last entry in file order, so the context is u1, a1 although a2 was written later.
    entries = [
        HEADER,
        _msg("u1", None, {"role": "user", "content": "hi"}),
        _msg("a1", "u1", _asst("first")),
        _msg("a2", "u1", _asst("second")),
        {"type": "custom", "id": "c1", "parentId": "a1", "timestamp": "t", "customType": "x", "data": {}},
    ]
    s = _one(_write(tmp_path, "a.jsonl", entries))
    assert [m["content"] for m in s.messages] == ["hi", "first"]
    s = _one(_write(tmp_path, "b.jsonl", entries[:4]))
    assert [m["content"] for m in s.messages] == ["hi", "second"]


def test_branched_fixture_follows_the_leaf():
    s = _one(SESSIONS / "003_branch.jsonl")
    roles = [m["role"] for m in s.messages]
    assert roles[:2] == ["user", "user"]  # the task, then the branch summary as user-side context
    assert s.messages[1]["content"].startswith(BRANCH_PREFIX)
    # the abandoned attempt (a read with limit 40) is not on the active path
    calls = [c["function"] for m in s.messages for c in m.get("tool_calls", [])]
    assert calls[0] == {"name": "bash", "arguments": {"command": "python -m pytest -q tests/test_stats.py"}}
    assert all(c["arguments"].get("limit") != 40 for c in calls)
    raw = (SESSIONS / "003_branch.jsonl").read_text()
    assert '"limit": 40' in raw  # ...although the file holds it


def test_compaction_emits_summary_then_kept_entries():
    s = _one(SESSIONS / "006_compaction.jsonl")
    first = s.messages[0]
    assert first["role"] == "user" and first["content"].startswith(COMPACTION_PREFIX)
    assert first["content"].endswith("\n</summary>")
    assert s.messages[1]["content"] == "Before you finish: list the files you touched."  # firstKeptEntryId
    text = json.dumps(s.messages)
    assert "Please fix it" not in text and "Add a function" not in text  # before the kept entry
    assert s.messages[-1]["role"] == "assistant" and "git status" in text


def test_messages_are_normalised():
    s = _one(SESSIONS / "004_follow_up.jsonl")
    assert s.tools is None
    a = next(m for m in s.messages if m.get("tool_calls"))
    call = a["tool_calls"][0]
    assert call["type"] == "function" and isinstance(call["function"]["arguments"], dict)
    assert a.get("reasoning_content")
    tool = next(m for m in s.messages if m["role"] == "tool")
    assert tool["tool_call_id"] == call["id"] and isinstance(tool["content"], str)
    assert {m["role"] for m in s.messages} == {"user", "assistant", "tool"}


def test_metadata_sources():
    s = _one(SESSIONS / "000_plain.jsonl")  # jaxpi.attempt custom entry
    assert (s.meta.effort, s.meta.verified, s.meta.task_id) == ("off", True, "demo-000")
    assert s.meta.source == str(SESSIONS / "000_plain.jsonl")
    s = _one(SESSIONS / "023_sidecar.jsonl")  # sidecar <file>.meta.json, no custom entry
    assert (s.meta.verified, s.meta.task_id) == (True, "demo-023")
    s = _one(SESSIONS / "016_unverified.jsonl")  # only thinking_level_change
    assert (s.meta.effort, s.meta.verified, s.meta.task_id) == ("high", None, None)
    s = _one(SESSIONS / "015_failed.jsonl")
    assert s.meta.verified is False


def test_custom_message_is_user_context():
    s = _one(SESSIONS / "010_custom_message.jsonl")
    assert {"role": "user", "content": "Reminder: keep answers short."} in s.messages


def test_openai_records():
    path = DEMO_DATA / "openai" / "records.jsonl"
    sessions, rejections = read_sessions([path])
    assert not rejections and len(sessions) == 4
    s = sessions[0]
    assert s.meta.source == f"{path}:1" and s.meta.task_id == "oa-0" and s.meta.verified is True
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "tool", "assistant"]
    args = s.messages[2]["tool_calls"][0]["function"]["arguments"]
    assert isinstance(args, dict) and args["command"].startswith("wc -l")  # JSON string -> dict
    assert s.messages[2]["reasoning_content"]
    assert [t["function"]["name"] for t in s.tools] == ["read", "bash", "edit", "write"]
    assert sessions[3].meta.source == f"{path}:4"


def test_directories_are_searched_recursively():
    sessions, rejections = read_sessions([DEMO_DATA])
    manifest = json.loads((DEMO_DATA / "manifest.json").read_text())
    assert len(sessions) + len(rejections) == len(manifest)


def test_errors_name_file_and_line(tmp_path):
    p = _write(
        tmp_path,
        "bad.jsonl",
        [HEADER, _msg("u1", None, {"role": "user", "content": "hi"}), '{"type": "message", "id": "a1", '],
    )
    _, rej = read_sessions([p])
    assert [(r.source, r.reason) for r in rej] == [(f"{p}:3", "invalid_json")]
    with pytest.raises(DataError, match=rf"{p}:3: invalid_json"):
        read_sessions([p], strict=True)

    p = _write(tmp_path, "noparent.jsonl", [HEADER, {"type": "message", "id": "u1", "message": {}}])
    _, rej = read_sessions([p])
    assert rej[0].source == f"{p}:2" and rej[0].reason == "missing_field"

    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    p = _write(tmp_path, "oa.jsonl", [good, {"msgs": []}, "not json", good])
    sessions, rej = read_sessions([p])
    assert len(sessions) == 2
    assert [(r.source, r.reason) for r in rej] == [(f"{p}:2", "missing_field"), (f"{p}:3", "invalid_json")]
    with pytest.raises(DataError, match=rf"{p}:2"):
        read_sessions([p], strict=True)


def test_images_are_excluded_with_a_reason():
    path = SESSIONS / "020_image.jsonl"
    sessions, rej = read_sessions([path])
    assert sessions == [] and rej[0].reason == "image_content" and rej[0].source.startswith(f"{path}:")


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        read_sessions([tmp_path / "nope"])


def test_branch_without_summary():
    s = _one(SESSIONS / "025_branch.jsonl")
    assert not any(BRANCH_PREFIX in (m["content"] or "") for m in s.messages)
    calls = [c["function"]["arguments"] for m in s.messages for c in m.get("tool_calls", [])]
    assert all(a.get("limit") != 40 for a in calls) and s.messages[1]["role"] == "assistant"


@pytest.mark.parametrize("stop", ["error", "aborted", "length"])
def test_unfinished_assistant_turns_are_rejected(tmp_path, stop):
    bad = {**_asst("partial"), "stopReason": stop}
    p = _write(
        tmp_path,
        "s.jsonl",
        [HEADER, _msg("u1", None, {"role": "user", "content": "hi"}), _msg("a1", "u1", bad)],
    )
    sessions, rej = read_sessions([p])
    assert sessions == [] and (rej[0].source, rej[0].reason) == (f"{p}:3", "assistant_error")


def test_user_bash_execution_becomes_user_text(tmp_path):
    run = {
        "role": "bashExecution",
        "command": "make",
        "output": "boom",
        "exitCode": 2,
        "cancelled": False,
        "truncated": False,
    }
    hidden = {**run, "command": "secret", "excludeFromContext": True}
    entries = [
        HEADER,
        _msg(
            "u1",
            None,
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ),
        _msg("b1", "u1", run),
        _msg("b2", "b1", hidden),
        _msg("a1", "b2", _asst("ok")),
    ]
    s = _one(_write(tmp_path, "s.jsonl", entries))
    assert [m["content"] for m in s.messages] == [
        "a\nb",
        "Ran `make`\n```\nboom\n```\n\nCommand exited with code 2",
        "ok",
    ]


def test_read_limits_are_validated():
    from jaxpi.data.sessions import ReadLimits

    assert ReadLimits().max_line_bytes == 4 * 2**20 and ReadLimits().max_session_bytes == 64 * 2**20
    for bad in (0, -1, 1.5, True, "4MiB"):
        with pytest.raises(ValueError, match="max_line_bytes"):
            ReadLimits(max_line_bytes=bad)


def test_messages_know_their_lines(tmp_path):
    entries = [HEADER, _msg("u1", None, {"role": "user", "content": "hi"}), "", _msg("a1", "u1", _asst("ok"))]
    p = _write(tmp_path, "s.jsonl", entries)
    s = _one(p)
    assert s.locations == (f"{p}:2", f"{p}:4") and s.location(1) == f"{p}:4"
    assert s.location(5) == str(p)  # out of range: the session's source
