"""`jaxpi gateway` in front of a real `jaxpi serve` (over HTTP, with the `openai` client): recorded
calls, token-exact merged trajectories, splits on edited history, and upstream failures.

Upstream is a tiny checkpoint whose head replays a scripted tool conversation
(`jaxpi.testing.scripted`), so a real two-call agent exchange happens at temperature 0.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from http.server import ThreadingHTTPServer

import httpx
import openai
import pytest
from test_agent_loop import spans  # the supervised runs of a mask, as the agent-loop tests read them

from jaxpi import TINY
from jaxpi.data.render import load_tokenizer
from jaxpi.gateway import build_samples, read_records, split_stats, start_gateway, think_ids, to_trajectory
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.serve import ServeConfig, start_server
from jaxpi.serve.handler import JsonHandler
from jaxpi.serve.httpbase import Handle
from jaxpi.serve.loading import Loaded
from jaxpi.testing.scripted import lookup_script, scripted_model

CFG = TINY.replace(hidden_size=128, intermediate_size=256)  # hidden >= the script's supervised tokens
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    ckpt = make_checkpoint(root / "ckpt", CFG, seed=2, tokenizer=True)
    messages, tools, effort = lookup_script()
    model, script = scripted_model(ckpt, messages, tools, effort)
    cfg = ServeConfig(
        model=str(ckpt), port=0, max_len=512, max_new_tokens=MAX_TOKENS, max_batch=2, prefill_chunks=(64, 1)
    )
    server = start_server(cfg, loaded=Loaded(model, ckpt, ckpt, ()))
    gw = start_gateway(server.url, port=0, record_dir=str(root / "records"), timeout_s=120)
    tok = load_tokenizer(str(ckpt))
    yield {
        "server": server,
        "gw": gw,
        "records": root / "records",
        "tok": tok,
        "script": script,
        "messages": messages,
        "tools": tools,
        "effort": effort,
    }
    gw.close()
    server.close()


def client(stack, attempt):
    """An OpenAI client whose API key is the token the gateway issued for `attempt`."""
    _, token = stack["gw"].gateway.open_attempt(attempt)
    return openai.OpenAI(base_url=stack["gw"].url + "/v1", api_key=token, max_retries=0)


def records(stack, attempt=None):
    """GET /jaxpi/attempts[/<attempt>] with the gateway's key."""
    url = stack["gw"].url + "/jaxpi/attempts" + (f"/{attempt}" if attempt else "")
    return httpx.get(url, headers={"Authorization": f"Bearer {stack['gw'].api_key}"})


def ask(stack, c, messages, stream):
    kw = dict(
        model="ckpt",
        messages=messages,
        tools=stack["tools"],
        reasoning_effort=stack["effort"],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    if not stream:
        r = c.chat.completions.create(**kw)
        assert "prompt_token_ids" not in r.model_extra and r.choices[0].logprobs is None  # extras stripped
        assert "token_ids" not in r.choices[0].model_extra
        m = r.choices[0].message
        return {
            "content": m.content,
            "reasoning": m.model_extra.get("reasoning"),
            "tool_calls": [tc.model_dump() for tc in m.tool_calls or []],
        }, r.choices[0].finish_reason
    msg = {"content": "", "reasoning": "", "tool_calls": []}
    finish = None
    for ch in c.chat.completions.create(stream=True, **kw):
        assert "prompt_token_ids" not in ch.model_extra
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        msg["content"] += d.content or ""
        msg["reasoning"] += d.model_extra.get("reasoning") or ""
        msg["tool_calls"] += [tc.model_dump(exclude_none=True) for tc in d.tool_calls or []]
        finish = ch.choices[0].finish_reason or finish
    for tc in msg["tool_calls"]:
        tc.pop("index", None)
    return msg, finish


@pytest.mark.parametrize("stream", [False, True])
def test_two_call_conversation_is_one_token_exact_sample(stack, stream):
    attempt = f"task-1.low.{int(stream)}"
    c = client(stack, attempt)
    msgs = list(stack["messages"][:2])
    m1, f1 = ask(stack, c, msgs, stream)
    assert f1 == "tool_calls" and m1["tool_calls"][0]["function"]["name"] == "get"
    call_id = m1["tool_calls"][0]["id"]
    msgs += [{"role": "assistant", **m1}, {"role": "tool", "tool_call_id": call_id, "content": "42"}]
    m2, f2 = ask(stack, c, msgs, stream)
    assert (f2, m2["content"], m2["reasoning"]) == ("stop", "It is 42.", "ok")

    calls = records(stack, attempt).json()["calls"]
    assert calls == read_records(stack["records"] / f"{attempt}.jsonl")  # file and endpoint agree
    assert [r["call"] for r in calls] == [0, 1] and all(r["error"] is None for r in calls)
    assert [r["stream"] for r in calls] == [stream, stream]
    assert [r["reasoning_effort"] for r in calls] == ["low", "low"]
    assert calls[1]["request"]["messages"][3]["content"] == "42"
    assert all(len(r["logprobs"]) == len(r["completion_token_ids"]) for r in calls)

    tok = stack["tok"]
    got = build_samples(calls, *think_ids(tok), attempt=attempt)
    assert (got.calls, got.splits, got.failed_calls, len(got.samples)) == (2, 0, (), 1)
    (s,) = got.samples
    # token-exact: the sample is the template's render of the whole conversation (with the
    # server's effort line), up to the last turn's end-of-turn token
    system = {"role": "system", "content": "You look up keys.\n\nReasoning effort: low."}
    final = [system, *msgs[1:], {"role": "assistant", "content": "It is 42.", "reasoning_content": "ok"}]
    for m in final:
        for tc in m.get("tool_calls") or []:
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    text = tok.apply_chat_template(final, tools=stack["tools"], tokenize=False, enable_thinking=True)
    assert text.endswith("<|im_end|>\n")
    assert s.token_ids == tok(text[:-1], add_special_tokens=False)["input_ids"] == stack["script"].ids
    # the mask covers exactly the two completions; logprobs sit on them and nowhere else
    assert spans(s.mask) == list(stack["script"].spans)
    assert [tok.decode(s.token_ids[a:b], skip_special_tokens=False) for a, b in spans(s.mask)] == list(
        stack["script"].texts
    )
    assert [lp for lp, m in zip(s.logprobs, s.mask, strict=True) if m] == calls[0]["logprobs"] + calls[1][
        "logprobs"
    ]
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask, strict=True) if not m)
    assert s.prompt_len == len(calls[0]["prompt_token_ids"]) and s.calls == (0, 1) and s.effort == "low"
    n = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert s.reasoning_tokens == n("find ab\n") + n("ok\n")
    assert s.output_tokens == sum(s.mask) == sum(len(r["completion_token_ids"]) for r in calls)
    traj = to_trajectory(s, "task-1", "low", success=True, attempt_id=attempt)
    assert (traj.token_ids, traj.mask, traj.turns, traj.reasoning_tokens) == (
        s.token_ids,
        s.mask,
        2,
        s.reasoning_tokens,
    )
    assert traj.to_attempt().admitted and traj.to_attempt().success


def test_edited_history_splits_into_two_samples(stack):
    attempt = "task-2.low.0"
    c = client(stack, attempt)
    msgs = list(stack["messages"][:2])
    m1, _ = ask(stack, c, msgs, False)
    # the client rewrites the user's question before the second call
    edited = [
        msgs[0],
        {"role": "user", "content": "What is ab, please?"},
        {"role": "assistant", **m1},
        {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "42"},
    ]
    ask(stack, c, edited, False)
    calls = records(stack, attempt).json()["calls"]
    got = build_samples(calls, *think_ids(stack["tok"]), attempt=attempt)
    assert (got.calls, got.splits, len(got.samples)) == (2, 1, 2)
    for s, r in zip(got.samples, calls, strict=True):
        assert s.token_ids == r["prompt_token_ids"] + r["completion_token_ids"]
        assert spans(s.mask) == [(len(r["prompt_token_ids"]), len(s.token_ids))]
    stats = split_stats(
        [
            got,
            build_samples(records(stack, "task-1.low.0").json()["calls"], *think_ids(stack["tok"])),
        ]
    )
    assert (stats["boundaries"], stats["splits"], stats["split_rate"]) == (2, 1, 0.5)


def test_build_samples_rules():
    def rec(k, p, o, **kw):
        return {
            "call": k,
            "prompt_token_ids": p,
            "completion_token_ids": o,
            "logprobs": [-0.5] * len(o),
            "finish_reason": "stop",
            "error": None,
            **kw,
        }

    err = {"call": 1, "error": {"message": "upstream down"}}
    # 3 = <think>, 4 = </think>; call 2 extends call 0 (the failed call 1 is skipped), call 3 does not
    recs = [
        rec(0, [1, 3], [7, 4, 8], reasoning_effort="high"),
        err,
        rec(2, [1, 3, 7, 4, 8, 9, 3], [5, 4]),
        rec(3, [1, 2], [6]),
    ]
    got = build_samples(recs, 3, 4)
    assert (got.calls, got.splits, got.failed_calls) == (3, 1, ("call 1: upstream down",))
    a, b = got.samples
    assert a.token_ids == [1, 3, 7, 4, 8, 9, 3, 5, 4] and a.mask == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert a.logprobs == [0, 0, -0.5, -0.5, -0.5, 0, 0, -0.5, -0.5] and a.reasoning_tokens == 2
    assert (a.calls, a.effort, b.calls, b.token_ids, b.mask) == ((0, 2), "high", (3,), [1, 2, 6], [0, 0, 1])
    with pytest.raises(ValueError, match="call 0: 1 logprobs for 2"):
        build_samples([{**rec(0, [1], [2, 3]), "logprobs": [-1.0]}], 3, 4, attempt="x")


class _Stub(JsonHandler):
    """An upstream that misbehaves: a malformed reply, or an answer after the gateway gave up."""

    def __init__(self, *a, mode, **kw):
        self.mode = mode
        super().__init__(*a, **kw)

    def do_POST(self):
        self.read_json()
        if self.mode == "slow":
            time.sleep(1.5)
        # The gateway gave up on a slow reply and closed the connection: nothing left to answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_json(
                200,
                {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]},
            )


def _stub(mode):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Stub, mode=mode))
    httpd.daemon_threads = True
    return Handle(httpd)


def test_upstream_faults_are_502_504_and_recorded(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for mode, status, kind, needle in [
        ("malformed", 502, "upstream_malformed", "prompt_token_ids"),
        ("slow", 504, "upstream_timeout", "within"),
    ]:
        with _stub(mode) as up, start_gateway(up.url, record_dir=str(tmp_path), timeout_s=0.5) as gw:
            _, token = gw.gateway.open_attempt(f"a-{mode}")
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            assert r.status_code == status and needle in r.json()["error"]["message"]
            (rec,) = read_records(tmp_path / f"a-{mode}.jsonl")
            assert (
                rec["status"] == status
                and rec["error"]["type"] == kind
                and rec["completion_token_ids"] is None
            )
            assert httpx.get(gw.url + "/health").json()["errors"] == 1


def test_upstream_killed_gives_502_and_gateway_stays_up(stack):
    """Runs last in this module: it stops the shared upstream server."""
    stack["server"].close()
    c = client(stack, "task-3.low.0")
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="ckpt", messages=stack["messages"][:2], max_tokens=4)
    assert e.value.status_code == 502 and "unreachable" in str(e.value)
    (rec,) = records(stack, "task-3.low.0").json()["calls"]
    assert rec["error"]["type"] == "upstream_unreachable" and rec["status"] == 502
    assert httpx.get(stack["gw"].url + "/health").json()["status"] == "ok"
    key = {"Authorization": f"Bearer {stack['gw'].api_key}"}
    assert httpx.get(stack["gw"].url + "/v1/models", headers=key).status_code == 502
    got = build_samples([rec], *think_ids(stack["tok"]))
    assert got.samples == () and got.failed_calls and "unreachable" in got.failed_calls[0]
    assert records(stack, "nobody").status_code == 404
    assert "task-3.low.0" in records(stack).json()["attempts"]


def _gateway_process(tmp_path, env):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpi.cli",
            "gateway",
            "--upstream",
            "http://127.0.0.1:9",
            "--port",
            "0",
            "--json",
            "--record-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    )


@pytest.mark.parametrize("key_from", ["env", "generated"])
def test_gateway_cli_process(tmp_path, key_from):
    env = {"JAXPI_API_KEY": "k-from-env"} if key_from == "env" else {}
    p = _gateway_process(tmp_path, env)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.poll() is not None else "no output"
        info = json.loads(line)
        # A generated key is printed (the only way to learn it); one from the environment is not.
        assert ("api_key" in info) == (key_from == "generated")
        key = info.get("api_key", "k-from-env")
        url = info["url"]
        assert httpx.get(url + "/jaxpi/attempts", timeout=30).status_code == 401
        r = httpx.post(
            url + "/jaxpi/attempts",
            json={"attempt": "a1"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 201 and r.json()["attempt"] == "a1"
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": []},
            headers={"Authorization": f"Bearer {r.json()['token']}"},
            timeout=30,
        )
        assert r.status_code == 502
        assert read_records(tmp_path / "a1.jsonl")[0]["error"]["type"] == "upstream_unreachable"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_gateway_flags_map_onto_the_config(monkeypatch):
    import argparse

    from jaxpi.cli.gateway import add_subparser, gateway_config

    parser = argparse.ArgumentParser()
    add_subparser(parser.add_subparsers())

    def cfg(*argv):
        return gateway_config(parser.parse_args(["gateway", "--upstream", "http://127.0.0.1:8000", *argv]))

    for var in ("JAXPI_API_KEY", "JAXPI_UPSTREAM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    c = cfg()
    assert (c.api_key, c.upstream_api_key, c.record_dir, c.limits.read_timeout_s) == (None, None, None, 30.0)
    monkeypatch.setenv("JAXPI_API_KEY", "gw-env")
    monkeypatch.setenv("JAXPI_UPSTREAM_API_KEY", "up-env")
    c = cfg("--http-workers", "4", "--max-request-mb", "0.5")
    assert (c.api_key, c.upstream_api_key, c.limits.workers, c.limits.max_body_bytes) == (
        "gw-env",
        "up-env",
        4,
        2**19,
    )
    assert "gw-env" not in repr(c) and "up-env" not in repr(c)
    c = cfg("--api-key", "gw-flag", "--upstream-api-key", "up-flag")
    assert (c.api_key, c.upstream_api_key) == ("gw-flag", "up-flag")
    with pytest.raises(ValueError, match="upstream must be an http"):
        gateway_config(parser.parse_args(["gateway", "--upstream", "127.0.0.1:8000"]))
