"""Fuzzing the loaders: the session reader (through the whole `jaxpi data check` pipeline) and the
safetensors header reader, with random JSON values in every field position and random bytes.

Properties: nothing raises but the documented error type; every rejection names `file:line` (a
line of the file) or the sidecar, under a known reason; every header the reader accepts is one
the reference implementation would accept (known dtypes, sizes that match, tensors that tile the
data region exactly). Fixed seed (`derandomize=True`), bounded examples: a few seconds in
`make test`; the `slow` variants run many more. A failing example prints as the Python literal
of the file's content (pass it to `_read` or `_header_file` to replay it).
"""

from __future__ import annotations

import copy
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from jaxpi.convert.safetensors_io import CheckpointError, read_header, read_index
from jaxpi.data import TINY_TOKENIZER, GateConfig, RenderConfig, build_examples
from jaxpi.data.gates import GateReport

FAST = settings(
    derandomize=True, max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SLOW = settings(
    derandomize=True, max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Bits per element of every dtype the safetensors crate knows (its `Dtype` enum).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8}
DTYPE_BITS |= {"F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32}
DTYPE_BITS |= {"C64": 64, "F64": 64, "I64": 64, "U64": 64}
READ_REASONS = {"unreadable_file", "line_too_long", "session_too_large", "invalid_utf8", "invalid_json"}
READ_REASONS |= {"missing_field", "bad_field", "bad_arguments", "unsupported_version", "empty_session"}
READ_REASONS |= {"duplicate_id", "unknown_parent", "cycle", "image_content", "assistant_error", "bad_sidecar"}
READ_REASONS |= {"unknown_entry", "unknown_target", "context_edit", "system_changed", "mixed_effort"}
GATE_REASONS = {
    "unknown_tool",
    "bad_arguments",
    "bad_tool_schema",
    "call_without_result",
    "result_without_call",
    "empty_assistant_turn",
    "not_ending_with_assistant",
    "verifier_failed",
    "verifier_unknown",
    "effort_not_allowed",
    "effort_unknown",
    "too_few_turns",
    "too_many_turns",
    "too_many_tokens",
    "render_error",
}
POLICY_REASONS = {"verifier_failed", "verifier_unknown", "effort_not_allowed", "effort_unknown"}
POLICY_REASONS |= {"too_few_turns", "too_many_turns", "too_many_tokens"}
RENDER = RenderConfig(TINY_TOKENIZER)
GATE = GateConfig(require_verified=False)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(
        ["text", "toolCall", "thinking", "image", "assistant", "user", "toolResult", "u1", "c1"]
    ),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)


def _pi_entries() -> list[dict]:
    call = {"type": "toolCall", "id": "c1", "name": "bash", "arguments": {"command": "ls"}}
    return [
        {"type": "session", "version": 3, "id": "s", "timestamp": "t", "cwd": "/w"},
        {"type": "thinking_level_change", "id": "t1", "parentId": None, "thinkingLevel": "low"},
        {
            "type": "message",
            "id": "u1",
            "parentId": "t1",
            "message": {"role": "user", "content": "list files"},
        },
        {
            "type": "message",
            "id": "a1",
            "parentId": "u1",
            "message": {"role": "assistant", "content": [{"type": "thinking", "thinking": "ls"}, call]},
        },
        {
            "type": "message",
            "id": "r1",
            "parentId": "a1",
            "message": {
                "role": "toolResult",
                "toolCallId": "c1",
                "toolName": "bash",
                "content": [{"type": "text", "text": "a.py"}],
            },
        },
        {"type": "compaction", "id": "k1", "parentId": "r1", "summary": "s", "firstKeptEntryId": "u1"},
        {
            "type": "message",
            "id": "a2",
            "parentId": "k1",
            "message": {
                "role": "assistant",
                "content": [{"type": "text", "text": "a.py"}],
                "stopReason": "stop",
            },
        },
        {
            "type": "custom",
            "id": "x1",
            "parentId": "a2",
            "customType": "jaxpi.attempt",
            "data": {"task_id": "t", "verified": True, "effort": "low"},
        },
    ]


def _oa_record() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "ls"},
            {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.py"},
            {"role": "assistant", "content": "a.py"},
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


def _paths(obj, prefix=()):
    """Every position in a JSON value: dict keys and list indices, depth first."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw, base):
    """`base` with one position set to a random JSON value (or its key deleted)."""
    obj = copy.deepcopy(base)
    paths = [p for p in _paths(obj) if p]
    path = draw(st.sampled_from(paths))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and draw(st.booleans()) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return obj


def _read(content: bytes, sidecar: bytes | None = None) -> tuple[int, GateReport]:
    """Run read -> gate -> render on one file with `content`; returns its line count and the report."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.jsonl"
        p.write_bytes(content)
        if sidecar is not None:
            (Path(d) / "s.jsonl.meta.json").write_bytes(sidecar)
        examples, report = build_examples([p], RENDER, GATE)
        lines = content.count(b"\n") + (not content.endswith(b"\n"))
        for r in report.excluded:
            assert r.reason in READ_REASONS | GATE_REASONS, r
            if r.source == f"{p}.meta.json":
                assert r.reason == "bad_sidecar"
                continue
            if r.reason in POLICY_REASONS and r.source == str(p):
                continue  # the admission policy judges a session, not a line
            name, _, line = r.source.rpartition(":")
            assert name == str(p) and 1 <= int(line) <= max(lines, 1), r
        assert report.admitted == len({e.source for e in examples})
        return lines, report


def _lines(entries: list) -> bytes:
    return b"".join((e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n" for e in entries)


def test_the_unmutated_fixtures_are_admitted():
    assert _read(_lines(_pi_entries()))[1].admitted == 1
    assert _read(_lines([_oa_record()] * 2))[1].admitted == 2


def _pi_property(data) -> None:
    entries = _pi_entries()
    k = data.draw(st.integers(0, len(entries) - 1))
    entries[k] = data.draw(mutated(entries[k]))
    content = _lines(entries)
    note(f"content={content!r}")
    _read(content)


def _oa_property(data) -> None:
    rec = data.draw(mutated(_oa_record()))
    content = _lines([rec, _oa_record()])
    note(f"content={content!r}")
    _, report = _read(content)
    assert report.admitted >= 1  # the untouched second record is read whatever the first holds


def _bytes_property(data) -> None:
    entries: list = _pi_entries()
    k = data.draw(st.integers(0, len(entries)))
    garbage = data.draw(st.binary(max_size=64).filter(lambda b: b"\n" not in b))
    if data.draw(st.booleans()):
        entries.insert(k, garbage)
    else:
        entries[min(k, len(entries) - 1)] = garbage
    sidecar = data.draw(
        st.none() | st.binary(max_size=32) | json_values.map(lambda v: json.dumps(v).encode())
    )
    content = _lines(entries)
    note(f"content={content!r}, sidecar={sidecar!r}")
    _read(content, sidecar)


@FAST
@given(st.data())
def test_fuzz_pi_fields(data):
    _pi_property(data)


@FAST
@given(st.data())
def test_fuzz_openai_fields(data):
    _oa_property(data)


@FAST
@given(st.data())
def test_fuzz_bytes_lines_and_sidecars(data):
    _bytes_property(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_fuzz_pi_fields_many(data):
    _pi_property(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_fuzz_openai_fields_many(data):
    _oa_property(data)


@pytest.mark.slow
@SLOW
@given(st.data())
def test_fuzz_bytes_lines_and_sidecars_many(data):
    _bytes_property(data)


# ---- safetensors headers -------------------------------------------------------------------------
def _header_file(raw: bytes) -> list:
    """read_header on a file holding `raw`: the TensorInfos, or the CheckpointError it raised."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.safetensors"
        f.write_bytes(raw)
        try:
            infos = read_header(f)
        except CheckpointError as e:
            assert str(f) in str(e), e  # every error names the file
            return [e]
        size = len(raw)
        (n,) = struct.unpack("<Q", raw[:8])
        at = 8 + n
        for t in sorted(infos, key=lambda t: (t.begin, t.end)):  # accepted: what safetensors accepts
            assert t.dtype in DTYPE_BITS and all(isinstance(d, int) and d >= 0 for d in t.shape)
            assert (t.end - t.begin) * 8 == math.prod(t.shape) * DTYPE_BITS[t.dtype]
            assert t.begin == at, (t, at)
            at = t.end
        assert at == size
        assert len({t.name for t in infos}) == len(infos)
        return infos


entry_values = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPE_BITS, "F33", ""]) | json_values,
        "shape": st.lists(st.integers(-2, 5), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-1, 80), min_size=2, max_size=2) | json_values,
    }
)


@st.composite
def header_files(draw) -> bytes:
    names = draw(st.lists(st.text(max_size=6), max_size=4, unique=True))
    header: dict = {}
    at = 0
    for name in names:
        if draw(st.integers(0, 3)) == 0:  # sometimes a random entry
            header[name] = draw(entry_values | json_values)
            continue
        code = draw(st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E4M3", "BOOL"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=2))
        nbytes = math.prod(shape) * DTYPE_BITS[code] // 8
        shift = draw(st.sampled_from([0, 0, 0, -1, 1, -4]))  # mostly consistent, sometimes off
        b = max(at + shift, 0)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [b, b + nbytes]}
        at = max(at, b + nbytes)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.just({"format": "pt"}) | json_values)
    raw = draw(st.just(json.dumps(header).encode()) | st.binary(max_size=40))
    length = draw(st.just(len(raw)) | st.integers(0, 2**64 - 1))
    data = draw(st.just(b"\0" * at) | st.binary(max_size=96))
    return draw(st.just(struct.pack("<Q", length)) | st.binary(max_size=10)) + raw + data


@FAST
@given(header_files())
def test_fuzz_safetensors_headers(raw):
    note(f"raw={raw!r}")
    _header_file(raw)


@pytest.mark.slow
@SLOW
@given(header_files())
def test_fuzz_safetensors_headers_many(raw):
    note(f"raw={raw!r}")
    _header_file(raw)


@FAST
@given(json_values | st.fixed_dictionaries({"weight_map": json_values}) | st.binary(max_size=40))
def test_fuzz_shard_index(index):
    with tempfile.TemporaryDirectory() as d:
        good = struct.pack("<Q", 2) + b"{}"
        (Path(d) / "model-00001-of-00001.safetensors").write_bytes(good)
        raw = index if isinstance(index, bytes) else json.dumps(index).encode()
        note(f"index={raw!r}")
        (Path(d) / "model.safetensors.index.json").write_bytes(raw)
        try:
            read_index(Path(d))
        except (CheckpointError, FileNotFoundError) as e:
            assert "model.safetensors.index.json" in str(e) or "no *.safetensors" in str(e), e
