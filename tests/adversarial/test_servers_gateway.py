"""Hostile clients of `jaxpi gateway`: naming another attempt to list, read or append to its
records (which become training data), a corrupt `.jsonl` among the records, records held in
memory forever, and calls without the gateway's API key.

A real gateway on loopback in front of an upstream that answers every chat call with a valid
reply (prompt ids, completion ids, logprobs) and remembers the Authorization header it saw.
"""

import gc
import json
import logging
import tracemalloc
from functools import partial
from http.server import ThreadingHTTPServer

import httpx
import pytest

from jaxpi.gateway import read_records, start_gateway
from jaxpi.serve.handler import JsonHandler
from jaxpi.serve.httpbase import Handle

ADMIN = "gw-admin-key-0123"
UPSTREAM_KEY = "sk-upstream-0123"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
REPLY = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
            "token_ids": [7, 8],
            "logprobs": {"content": [{"token": "o", "logprob": -0.5}, {"token": "k", "logprob": -0.25}]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


class _Upstream(JsonHandler):
    def __init__(self, *a, seen, key, **kw):
        self.seen, self.key = seen, key
        super().__init__(*a, **kw)

    def _auth(self):
        self.seen.append(self.headers.get("Authorization"))
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_json(401, {"error": {"message": "bad key", "type": "x", "code": 401}})
            return False
        return True

    def do_POST(self):
        self.read_json()
        if self._auth():
            self.send_json(200, REPLY)

    def do_GET(self):
        if self._auth():
            self.send_json(200, {"object": "list", "data": [{"id": "m"}]})


@pytest.fixture
def upstream():
    seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Upstream, seen=seen, key=UPSTREAM_KEY))
    httpd.daemon_threads = True
    with Handle(httpd) as h:
        h.seen = seen
        yield h


@pytest.fixture
def gw(upstream, tmp_path):
    with start_gateway(
        upstream.url, record_dir=str(tmp_path), api_key=ADMIN, upstream_api_key=UPSTREAM_KEY, timeout_s=10
    ) as h:
        yield h


def admin():
    return {"Authorization": f"Bearer {ADMIN}"}


def chat(gw, headers):
    return httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10)


def record(attempt, call):
    return {
        "attempt": attempt,
        "call": call,
        "time": 0.0,
        "latency_s": 0.0,
        "stream": False,
        "request": CHAT,
        "reasoning_effort": None,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [7, 8],
        "logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "ok"},
        "usage": None,
        "status": 200,
        "error": None,
    }


def test_a_client_cannot_list_read_or_append_to_another_attempt(gw, tmp_path):
    # The victim's attempt has one call on record.
    gw.gateway.store.append(
        "victim", {k: v for k, v in record("victim", 0).items() if k not in ("attempt", "call")}
    )
    before = (tmp_path / "victim.jsonl").read_bytes()
    # An attacker on the same host (the sandbox reaches the gateway's port) knows the id ...
    named = ({}, {"Authorization": "Bearer victim"}, {"X-Jaxpi-Attempt": "victim"})

    def cannot_read(headers):
        r = httpx.get(gw.url + "/jaxpi/attempts", headers=headers, timeout=5)
        assert r.status_code in (401, 403) and "victim" not in r.text, (headers, r.text)
        r = httpx.get(gw.url + "/jaxpi/attempts/victim", headers=headers, timeout=5)
        assert r.status_code in (401, 403) and "prompt_token_ids" not in r.text, (headers, r.text)

    def cannot_append(headers):
        r = chat(gw, headers)
        assert r.status_code in (401, 403), (headers, r.status_code, r.text)
        assert r.json()["error"]["type"] in ("AuthenticationError", "permission_error")
        assert (tmp_path / "victim.jsonl").read_bytes() == before

    for headers in named:
        cannot_read(headers)
    # ... and cannot append to it: not as its API key, nor by naming it in X-Jaxpi-Attempt.
    for headers in named[1:] + ({"Authorization": "Bearer victim", "X-Jaxpi-Attempt": "victim"},):
        cannot_append(headers)
    # Nor with a token of its own attempt.
    mine = httpx.post(gw.url + "/jaxpi/attempts", json={"attempt": "attacker"}, headers=admin(), timeout=5)
    assert mine.status_code == 201
    own = {"Authorization": f"Bearer {mine.json()['token']}"}
    cannot_read(own)
    cannot_append({**own, "X-Jaxpi-Attempt": "victim"})
    # Its own token files its calls under its own attempt, and only there.
    assert chat(gw, own).status_code == 200
    assert [c["attempt"] for c in read_records(tmp_path / "attacker.jsonl")] == ["attacker"]
    # An attempt's token stops working once the attempt is closed (its records are collected).
    assert (
        httpx.post(gw.url + "/jaxpi/attempts/attacker/close", headers=admin(), timeout=5).status_code == 200
    )
    assert chat(gw, own).status_code == 401
    assert len(read_records(tmp_path / "attacker.jsonl")) == 1


def test_attempts_are_issued_by_the_gateway(gw, tmp_path):
    a = gw.gateway.open_attempt("task-1.low.0")
    assert a[0] == "task-1.low.0" and len(a[1]) >= 32
    # One id, one token: the id of a live or recorded attempt is not handed out again.
    r = httpx.post(gw.url + "/jaxpi/attempts", json={"attempt": "task-1.low.0"}, headers=admin(), timeout=5)
    assert r.status_code == 409
    gw.gateway.store.append(
        "old", {k: v for k, v in record("old", 0).items() if k not in ("attempt", "call")}
    )
    r = httpx.post(gw.url + "/jaxpi/attempts", json={"attempt": "old"}, headers=admin(), timeout=5)
    assert r.status_code == 409
    for bad in ("../x", "", "a" * 200, 7, ".hidden"):
        r = httpx.post(gw.url + "/jaxpi/attempts", json={"attempt": bad}, headers=admin(), timeout=5)
        assert r.status_code == 400, bad
    # Without a name the gateway picks one; only the admin key may create attempts.
    r = httpx.post(gw.url + "/jaxpi/attempts", json={}, headers=admin(), timeout=5)
    assert r.status_code == 201 and r.json()["attempt"] and r.json()["token"]
    tok = {"Authorization": f"Bearer {r.json()['token']}"}
    for headers in ({}, tok, {"Authorization": "Bearer task-1.low.0"}):
        assert httpx.post(gw.url + "/jaxpi/attempts", json={}, headers=headers, timeout=5).status_code in (
            401,
            403,
        )
    # The admin key may name the attempt of a call itself (a trusted caller, as before).
    r = chat(gw, {**admin(), "X-Jaxpi-Attempt": "by-admin"})
    assert r.status_code == 200 and read_records(tmp_path / "by-admin.jsonl")[0]["call"] == 0
    assert chat(gw, admin()).status_code == 400  # the admin key alone names no attempt


def test_records_are_streamed_to_disk_not_kept_in_memory(gw):
    payload = {k: v for k, v in record("big", 0).items() if k not in ("attempt", "call")}
    payload["request"] = {"messages": [{"role": "user", "content": ""}]}
    store = gw.gateway.store
    store.append("big", dict(payload))  # the attempt's first write (opens what it needs)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(200):  # 4 MB of records, each its own text
            text = f"{i:05d}" + "x" * 20_000
            store.append("big", {**payload, "request": {"messages": [{"role": "user", "content": text}]}})
            del text
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kept < 500_000, f"{kept} bytes still held after writing 4 MB of records"
    assert len(store.get("big")) == 201 and store.attempts()["big"] == 201
    # Served from the file: what is on disk is what a reader gets.
    calls = httpx.get(gw.url + "/jaxpi/attempts/big", headers=admin(), timeout=10).json()["calls"]
    assert [c["call"] for c in calls] == list(range(201))


def test_without_a_record_dir_records_go_to_a_private_temp_dir(upstream):
    with start_gateway(upstream.url, api_key=ADMIN, upstream_api_key=UPSTREAM_KEY) as h:
        d = h.gateway.store.dir
        assert d is not None and d.is_dir() and (d.stat().st_mode & 0o077) == 0
        _, token = h.gateway.open_attempt("a")
        assert chat(h, {"Authorization": f"Bearer {token}"}).status_code == 200
        assert (d / "a.jsonl").is_file()
    assert not d.exists()


def test_a_corrupt_jsonl_is_skipped_with_one_warning_naming_file_and_line(gw, tmp_path, caplog):
    good = json.dumps(record("good", 0))
    (tmp_path / "good.jsonl").write_text(good + "\n")
    bad = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(record("bad", 0)),
        "{not json",
        "[1, 2]",
        json.dumps({**record("bad", 2), "logprobs": [-1.0]}),  # one logprob for two tokens
        json.dumps({**record("bad", 3), "call": "three"}),
        "\x00\udcff garbage",
        json.dumps(record("bad", 6)),
    ]
    # The last line cut by a crash mid-write: dropped without a word.
    bad.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b'\n{"torn": ')
    with caplog.at_level(logging.WARNING, logger="jaxpi.gateway"):
        for _ in range(2):
            r = httpx.get(gw.url + "/jaxpi/attempts", headers=admin(), timeout=5)
            assert r.status_code == 200, r.text
            assert r.json()["attempts"] == {"bad": 2, "good": 1}
            r = httpx.get(gw.url + "/jaxpi/attempts/bad", headers=admin(), timeout=5)
            assert r.status_code == 200 and [c["call"] for c in r.json()["calls"]] == [0, 6]
    warned = [m.getMessage() for m in caplog.records if m.name.startswith("jaxpi.gateway")]
    for line in (2, 3, 4, 5, 6):
        hits = [w for w in warned if f"{bad}:{line}:" in w]
        assert len(hits) == 1, (line, warned)  # once per file:line, however often it is read
    assert not any(f"{bad}:8:" in w for w in warned)
    # An append after the torn tail starts on a line of its own; call k is always line k + 1.
    _, token = gw.gateway.open_attempt("fresh")
    bad.rename(tmp_path / "fresh.jsonl")
    assert chat(gw, {"Authorization": f"Bearer {token}"}).status_code == 200
    calls = read_records(tmp_path / "fresh.jsonl")
    assert calls[-1]["attempt"] == "fresh" and calls[-1]["call"] == 8


def test_the_gateway_requires_its_api_key(gw):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": ADMIN}):
        for method, path in (
            ("GET", "/jaxpi/attempts"),
            ("GET", "/jaxpi/attempts/x"),
            ("POST", "/jaxpi/attempts"),
            ("POST", "/jaxpi/attempts/x/close"),
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
        ):
            r = httpx.request(method, gw.url + path, headers=headers, json={}, timeout=5)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gw.url + "/health", timeout=5).status_code == 200


def test_the_gateway_sends_upstream_its_own_key_never_the_clients(gw, upstream):
    _, token = gw.gateway.open_attempt("k")
    assert chat(gw, {"Authorization": f"Bearer {token}"}).status_code == 200
    assert (
        httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code
        == 200
    )
    assert upstream.seen and set(upstream.seen) == {f"Bearer {UPSTREAM_KEY}"}
