"""Hostile session files against `jaxpi data check`: every malformed line is a named rejection.

Each probe is one malformed-but-plausible session (a Pi v3 file or an OpenAI-style record) put
next to a good session. `jaxpi data check` must carry on past it (the good one is admitted), exit
0, and report the probe under its reason at `file:line` (the line that holds the fault). Wrongly
typed fields are rejections, never a traceback and never a silent misreading (an effort `{...}`
turned into the string "{...}", a verifier flag "false" read as a flag).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpi.cli import main
from jaxpi.data import read_sessions

HEADER = {"type": "session", "version": 3, "id": "s1", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/w"}


def _entry(kind: str, eid: str, parent: str | None, **fields) -> dict:
    return {"type": kind, "id": eid, "parentId": parent, "timestamp": "t", **fields}


def _msg(eid: str, parent: str | None, message: dict) -> dict:
    return _entry("message", eid, parent, message=message)


def pi_entries() -> list[dict]:
    """A good Pi session; line numbers are list index + 1."""
    call = {"type": "toolCall", "id": "c1", "name": "bash", "arguments": {"command": "ls"}}
    return [
        HEADER,  # 1
        _entry("thinking_level_change", "t1", None, thinkingLevel="low"),  # 2
        _msg("u1", "t1", {"role": "user", "content": "list files"}),  # 3
        _msg("a1", "u1", {"role": "assistant", "content": [call], "stopReason": "toolUse"}),  # 4
        _msg(  # 5
            "r1",
            "a1",
            {
                "role": "toolResult",
                "toolCallId": "c1",
                "toolName": "bash",
                "content": [{"type": "text", "text": "a.py"}],
            },
        ),
        _msg(  # 6
            "a2",
            "r1",
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "There is a.py."}],
                "stopReason": "stop",
            },
        ),
        _entry(  # 7
            "custom",
            "x1",
            "a2",
            customType="jaxpi.attempt",
            data={"task_id": "t", "verified": True, "effort": "low"},
        ),
    ]


def oa_record() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    return {
        "messages": [
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "use ls"},
            {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.py"},
            {"role": "assistant", "content": "There is a.py."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "parameters": {
                        "type": "object",
                        "properties": {"command": {"type": "string"}},
                        "required": ["command"],
                    },
                },
            }
        ],
        "meta": {"task_id": "oa", "verified": True, "effort": "low"},
    }


def _set(obj, path: tuple, value):
    obj = copy.deepcopy(obj)
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def _lines(entries: list) -> bytes:
    out = b""
    for e in entries:
        out += (e if isinstance(e, bytes) else json.dumps(e, ensure_ascii=False).encode()) + b"\n"
    return out


# (probe id, line of the fault, path into that line's JSON, value put there, reason expected)
PI_FIELD_PROBES = [
    ("assistant_content_string", 6, ("message", "content"), "There is a.py.", "bad_field"),
    ("id_list", 4, ("id",), ["a1"], "bad_field"),
    ("parent_id_list", 5, ("parentId",), ["a1"], "bad_field"),
    ("type_list", 4, ("type",), ["message"], "bad_field"),
    ("user_content_int_block", 3, ("message", "content"), [5], "bad_field"),
    ("assistant_int_block", 6, ("message", "content"), [5], "bad_field"),
    ("message_list", 3, ("message",), ["user", "list files"], "bad_field"),
    ("message_string", 3, ("message",), "list files", "bad_field"),
    ("role_list", 3, ("message", "role"), ["user"], "bad_field"),
    ("text_block_int", 6, ("message", "content", 0, "text"), 7, "bad_field"),
    ("tool_result_text_int", 5, ("message", "content", 0, "text"), 7, "bad_field"),
    ("tool_result_call_id_list", 5, ("message", "toolCallId"), ["c1"], "bad_field"),
    ("tool_call_id_list", 4, ("message", "content", 0, "id"), ["c1"], "bad_field"),
    ("tool_call_name_list", 4, ("message", "content", 0, "name"), ["bash"], "bad_field"),
    (
        "tool_call_arguments_string",
        4,
        ("message", "content", 0, "arguments"),
        '{"command": "ls"}',
        "bad_field",
    ),
    ("stop_reason_list", 6, ("message", "stopReason"), ["stop"], "bad_field"),
    ("thinking_level_dict", 2, ("thinkingLevel",), {"level": "low"}, "bad_field"),
    ("attempt_data_list", 7, ("data",), ["task_id"], "bad_field"),
    ("attempt_data_string", 7, ("data",), "verified", "bad_field"),
    ("attempt_verified_string", 7, ("data", "verified"), "false", "bad_field"),
    ("attempt_effort_dict", 7, ("data", "effort"), {"level": "low"}, "bad_field"),
    ("attempt_task_id_list", 7, ("data", "task_id"), ["t"], "bad_field"),
    ("header_version_string", 1, ("version",), "3", "unsupported_version"),
]


def _pi_extra(kind: str, value) -> tuple[list[dict], int]:
    """A good session with one more entry of `kind` (carrying `value`) before the last answer."""
    e = pi_entries()
    u2 = _msg("u2", "k1", {"role": "user", "content": "and now?"})
    a3 = _msg(
        "a3",
        "u2",
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}], "stopReason": "stop"},
    )
    attempt = {**e[6], "parentId": "a3"}
    extra = {
        "compaction_summary_int": _entry("compaction", "k1", "a2", summary=value, firstKeptEntryId="u1"),
        "compaction_kept_list": _entry("compaction", "k1", "a2", summary="s", firstKeptEntryId=value),
        "branch_summary_list": _entry("branch_summary", "k1", "a2", summary=value, fromId="a1"),
        "custom_message_int_block": _entry("custom_message", "k1", "a2", customType="x", content=value),
        "bash_output_list": _msg("k1", "a2", {"role": "bashExecution", "command": "make", "output": value}),
        "bash_exit_code_string": _msg(
            "k1", "a2", {"role": "bashExecution", "command": "make", "output": "ok", "exitCode": value}
        ),
    }[kind]
    return [*e[:6], extra, u2, a3, attempt], 7


PI_ENTRY_PROBES = [
    ("compaction_summary_int", 5),
    ("compaction_kept_list", ["u1"]),
    ("branch_summary_list", ["gone"]),
    ("custom_message_int_block", [3]),
    ("bash_output_list", ["boom"]),
    ("bash_exit_code_string", "2"),
]

OA_FIELD_PROBES = [
    ("meta_list", ("meta",), ["oa"], "bad_field"),
    ("meta_string", ("meta",), "verified", "bad_field"),
    ("tools_list_of_strings", ("tools",), ["read", "bash"], "bad_field"),
    ("tools_string", ("tools",), "bash", "bad_field"),
    ("tool_name_int", ("tools", 0, "function", "name"), 5, "bad_field"),
    ("tool_parameters_list", ("tools", 0, "function", "parameters"), ["command"], "bad_field"),
    (
        "tool_properties_list",
        ("tools", 0, "function", "parameters", "properties"),
        ["command"],
        "bad_tool_schema",
    ),
    (
        "tool_schema_enum",
        ("tools", 0, "function", "parameters", "properties", "command", "enum"),
        ["ls"],
        "bad_tool_schema",
    ),
    ("messages_string", ("messages",), "list files", "bad_field"),
    ("message_int", ("messages", 0), 5, "bad_field"),
    ("role_int", ("messages", 0, "role"), 1, "bad_field"),
    ("content_int", ("messages", 3, "content"), 5, "bad_field"),
    ("content_dict", ("messages", 3, "content"), {"text": "x"}, "bad_field"),
    ("content_int_part", ("messages", 0, "content"), [5], "bad_field"),
    ("content_part_text_int", ("messages", 0, "content"), [{"type": "text", "text": 5}], "bad_field"),
    ("reasoning_int", ("messages", 1, "reasoning_content"), 5, "bad_field"),
    ("tool_calls_string", ("messages", 1, "tool_calls"), "bash", "bad_field"),
    ("tool_call_id_list", ("messages", 1, "tool_calls", 0, "id"), ["c1"], "bad_field"),
    ("tool_call_name_list", ("messages", 1, "tool_calls", 0, "function", "name"), ["bash"], "bad_field"),
    (
        "tool_call_arguments_json_list",
        ("messages", 1, "tool_calls", 0, "function", "arguments"),
        "[1]",
        "bad_arguments",
    ),
    ("tool_call_arguments_int", ("messages", 1, "tool_calls", 0, "function", "arguments"), 5, "bad_field"),
    ("tool_call_id_of_result_list", ("messages", 2, "tool_call_id"), ["c1"], "bad_field"),
    ("tool_name_of_result_list", ("messages", 2, "name"), ["bash"], "bad_field"),
    ("verified_string", ("meta", "verified"), "false", "bad_field"),
    ("effort_int", ("meta", "effort"), 3, "bad_field"),
    ("task_id_dict", ("meta", "task_id"), {"id": 1}, "bad_field"),
    (
        "system_after_user",  # the chat template raises: a system message is only allowed first
        ("messages",),
        [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "ok"},
        ],
        "render_error",
    ),
]


def _check(tmp_path: Path, capsys, *extra: str) -> tuple[int, dict]:
    rc = main(["data", "check", str(tmp_path), "--json", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def _good(tmp_path: Path) -> None:
    (tmp_path / "good.jsonl").write_bytes(_lines(pi_entries()))


def _assert_rejected(report: dict, source: str, reason: str) -> None:
    gates = report["gates"]
    got = [(r["source"], r["reason"]) for r in gates["excluded"]]
    assert (source, reason) in got, got
    assert gates["admitted"] == 1, gates  # the good session next to it still went through


def test_good_fixtures_are_admitted(tmp_path, capsys):
    _good(tmp_path)
    (tmp_path / "oa.jsonl").write_text(json.dumps(oa_record()) + "\n")
    rc, report = _check(tmp_path, capsys)
    assert rc == 0 and report["gates"]["admitted"] == 2 and report["gates"]["excluded"] == []


@pytest.mark.parametrize(
    ("probe", "line", "path", "value", "reason"), PI_FIELD_PROBES, ids=[p[0] for p in PI_FIELD_PROBES]
)
def test_pi_field_of_the_wrong_type_is_a_rejection_at_its_line(
    tmp_path, capsys, probe, line, path, value, reason
):
    _good(tmp_path)
    entries = pi_entries()
    entries[line - 1] = _set(entries[line - 1], path, value)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:{line}", reason)


@pytest.mark.parametrize(("probe", "value"), PI_ENTRY_PROBES, ids=[p[0] for p in PI_ENTRY_PROBES])
def test_pi_entry_of_the_wrong_shape_is_a_rejection_at_its_line(tmp_path, capsys, probe, value):
    _good(tmp_path)
    entries, line = _pi_extra(probe, value)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:{line}", "bad_field")


@pytest.mark.parametrize(
    ("probe", "path", "value", "reason"), OA_FIELD_PROBES, ids=[p[0] for p in OA_FIELD_PROBES]
)
def test_openai_field_of_the_wrong_type_is_a_rejection_at_its_line(
    tmp_path, capsys, probe, path, value, reason
):
    _good(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in [_set(oa_record(), path, value), oa_record()]) + "\n")
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    gates = report["gates"]
    got = [(r["source"], r["reason"]) for r in gates["excluded"]]
    assert (f"{bad}:1", reason) in got, got
    assert gates["admitted"] == 2, gates  # line 2 of the same file and the Pi session


def test_duplicate_entry_id_is_a_rejection(tmp_path, capsys):
    _good(tmp_path)
    entries = pi_entries()
    # a second entry named "u1" on another branch: which one a child's parentId means is ambiguous
    entries.insert(4, _msg("u1", "t1", {"role": "user", "content": "something else"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:5", "duplicate_id")


def test_a_branch_without_messages_is_a_rejection_at_its_leaf(tmp_path, capsys):
    _good(tmp_path)
    entries = pi_entries()
    entries[6] = _set(entries[6], ("parentId",), None)  # the leaf starts a branch of its own
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:7", "empty_session")


# ---- bytes that are not JSON text ----------------------------------------------------------------
def test_binary_garbage_is_a_rejection_that_names_the_file(tmp_path, capsys):
    _good(tmp_path)
    bad = tmp_path / "garbage.jsonl"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01garbage\n" + bytes(range(256)) + b"\n")
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    got = {(r["source"], r["reason"]) for r in report["gates"]["excluded"]}
    assert (f"{bad}:1", "invalid_utf8") in got, got
    assert report["gates"]["admitted"] == 1


def test_an_undecodable_line_inside_a_pi_session_is_named(tmp_path, capsys):
    _good(tmp_path)
    entries: list = pi_entries()
    entries[4] = (
        b'{"type": "message", "id": "r1", "parentId": "a1", "message": {"role": "toolResult\xc3\x28"}}'
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:5", "invalid_utf8")


def test_unicode_line_separators_inside_strings_are_text_not_line_breaks(tmp_path):
    # JSON allows U+2028/U+2029 (and U+0085, \x1c...) raw inside strings, and JavaScript writers
    # (Pi) emit them raw; only "\n" ends a JSONL record.
    entries = pi_entries()
    text = "a\u2028b\u2029c\x85d\x1ce"
    entries[2] = _set(entries[2], ("message", "content"), text)
    p = tmp_path / "s.jsonl"
    p.write_bytes(_lines(entries))
    sessions, rejections = read_sessions([p])
    assert rejections == [] and sessions[0].messages[0]["content"] == text


def test_crlf_line_endings_are_read(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_bytes(_lines(pi_entries()).replace(b"\n", b"\r\n"))
    sessions, rejections = read_sessions([p])
    assert rejections == [] and len(sessions) == 1


def test_deeply_nested_json_is_a_rejection(tmp_path, capsys):
    _good(tmp_path)
    entries: list = pi_entries()
    entries[3] = (
        b'{"type": "message", "id": "a1", "parentId": "u1", "message": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, f"{bad}:4", "invalid_json")


# ---- sidecars ------------------------------------------------------------------------------------
SIDECARS = {
    "not_json": b"{verified: true",
    "binary": b"\xff\xfe\x00\x00",
    "a_list": b'["verified", true]',
    "verified_string": b'{"verified": "yes"}',
    "effort_int": b'{"verified": true, "effort": 3}',
    "empty": b"",
}


@pytest.mark.parametrize("kind", list(SIDECARS))
def test_a_bad_sidecar_rejects_its_session_and_names_the_sidecar(tmp_path, capsys, kind):
    _good(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(pi_entries()))
    sidecar = tmp_path / "bad.jsonl.meta.json"
    sidecar.write_bytes(SIDECARS[kind])
    rc, report = _check(tmp_path, capsys)
    assert rc == 0
    _assert_rejected(report, str(sidecar), "bad_sidecar")


# ---- size caps -----------------------------------------------------------------------------------
def test_a_20mb_line_is_rejected_quickly(tmp_path):
    rec = oa_record()
    rec["messages"][3]["content"] = "word " * 4_000_000  # 20 MB of text in one record
    p = tmp_path / "big.jsonl"
    p.write_text(json.dumps(oa_record()) + "\n" + json.dumps(rec) + "\n" + json.dumps(oa_record()) + "\n")
    t0 = time.perf_counter()
    sessions, rejections = read_sessions([p])
    seconds = time.perf_counter() - t0
    assert [(r.source, r.reason) for r in rejections] == [(f"{p}:2", "line_too_long")]
    assert "bytes" in rejections[0].detail and len(sessions) == 2
    assert seconds < 2.0, seconds


def test_a_session_over_the_size_cap_is_rejected(tmp_path):
    from jaxpi.data.sessions import ReadLimits

    entries = pi_entries()
    big = "x" * 1000
    p = tmp_path / "s.jsonl"
    entries[2] = _set(entries[2], ("message", "content"), big)
    p.write_bytes(_lines(entries))
    limits = ReadLimits(max_line_bytes=4096, max_session_bytes=2048)
    sessions, rejections = read_sessions([p], limits=limits)
    assert sessions == [] and rejections[0].reason == "session_too_large"
    assert rejections[0].source.startswith(f"{p}:")
    sessions, rejections = read_sessions([p], limits=ReadLimits(max_line_bytes=512))
    assert sessions == [] and (rejections[0].source, rejections[0].reason) == (f"{p}:3", "line_too_long")


# ---- the command ---------------------------------------------------------------------------------
def test_gate_faults_name_the_line_of_the_message(tmp_path, capsys):
    entries = pi_entries()
    entries[3] = _set(entries[3], ("message", "content", 0, "name"), "grep")
    p = tmp_path / "s.jsonl"
    p.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 1  # nothing admitted
    assert [(r["source"], r["reason"]) for r in report["gates"]["excluded"]] == [(f"{p}:4", "unknown_tool")]
    assert report["gates"]["excluded_sessions"] == 1


def test_render_faults_name_the_line_of_the_turn(tmp_path, capsys):
    entries = pi_entries()
    # reasoning in a turn of effort "off": the template renders it with thinking disabled, which
    # is not a sequence the model could have produced
    entries[5] = _set(
        entries[5],
        ("message", "content"),
        [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "ok"}],
    )
    entries[6] = _set(entries[6], ("data", "effort"), "off")
    p = tmp_path / "s.jsonl"
    p.write_bytes(_lines(entries))
    rc, report = _check(tmp_path, capsys)
    assert rc == 1
    assert [(r["source"], r["reason"]) for r in report["gates"]["excluded"]] == [(f"{p}:6", "render_error")]


def test_bad_invocations_exit_2_without_a_traceback(tmp_path, capsys):
    _good(tmp_path)
    for args in (["--min-turns", "x"], ["--max-line-bytes", "-1"], ["--max-session-bytes", "0"]):
        with pytest.raises(SystemExit) as e:  # argparse: usage and the reason on stderr
            main(["data", "check", str(tmp_path), *args])
        assert e.value.code == 2 and "error:" in capsys.readouterr().err, args
    assert main(["data", "check", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    # the console script itself, on binary garbage: exit 1 (nothing admitted), no traceback
    (tmp_path / "good.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    r = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "data", "check", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{tmp_path / 'good.jsonl'}:1: invalid_utf8" in r.stdout
