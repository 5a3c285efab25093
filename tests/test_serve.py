"""`jaxpi serve` over real HTTP, driven by the `openai` client: chat with tools (streaming or not),
token-id completions against the trainer's log-probs, batching of concurrent requests, errors.

The served model is a tiny random checkpoint whose LM head is solved to replay one scripted tool
conversation (`jaxpi.testing.scripted`), so greedy requests produce real tool calls through the
real engine; other prompts get the random model's output.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jaxpi import TINY
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.rl.loss import sequence_logprobs
from jaxpi.serve import ServeConfig, start_server
from jaxpi.serve.chat import ChatFormat
from jaxpi.serve.loading import Loaded
from jaxpi.serve.protocol import read_chat_request
from jaxpi.serve.streaming import TurnStream
from jaxpi.testing.scripted import lookup_script, scripted_model

# hidden 128 >= the script's 67 supervised tokens: the head fit is exact
CFG = TINY.replace(hidden_size=128, intermediate_size=256)
MAX_TOKENS = 64  # one decode program for the whole module
# Engine vs trainer in float32. tests/test_jax_engine.py measures ~1e-5 (TOL 2e-5) on a random
# model: XLA's fp32 matmuls round by shape ([B, 1, D] decode rows vs [1, T, D] trainer rows),
# amplified by the DeltaNet output norm. The solved head here has larger weights and scales that
# gap to up to ~5e-5 (measured); a wrong weight or an off-by-one position is off by > 1e-2.
TOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt", CFG, seed=2, tokenizer=True)
    messages, tools, effort = lookup_script()
    model, script = scripted_model(ckpt, messages, tools, effort)
    cfg = ServeConfig(
        model=str(ckpt),
        port=0,
        max_len=512,
        max_new_tokens=MAX_TOKENS,
        max_batch=4,
        batch_wait_ms=300,
        prefill_chunks=(64, 1),
    )
    handle = start_server(cfg, loaded=Loaded(model, ckpt, ckpt, ()))
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="test", max_retries=0)
    yield {
        "h": handle,
        "client": client,
        "script": script,
        "model": model,
        "ckpt": ckpt,
        "tok": load_tokenizer(str(ckpt)),
        "messages": messages,
        "tools": tools,
        "effort": effort,
    }
    handle.close()


def ask(s, messages, **kw):
    return s["client"].chat.completions.create(
        model="ckpt",
        messages=messages,
        tools=s["tools"],
        reasoning_effort=s["effort"],
        temperature=0,
        max_tokens=MAX_TOKENS,
        **kw,
    )


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_chat_tool_call_ids_usage_logprobs(served):
    s, script = served, served["script"]
    (a0, a1), _ = script.spans
    r = ask(s, s["messages"][:2], logprobs=True, extra_body={"return_token_ids": True})
    (c,) = r.choices
    assert c.finish_reason == "tool_calls"
    msg = c.message
    assert msg.content in (None, "") and msg.model_extra["reasoning"] == "find ab"
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get"
    assert json.loads(call.function.arguments) == {"key": "ab"}
    # token-exact: the prompt is the script's prompt, the completion the script's turn
    assert r.model_extra["prompt_token_ids"] == script.ids[:a0]
    assert c.model_extra["token_ids"] == script.ids[a0:a1]
    assert r.usage.prompt_tokens == a0 and r.usage.completion_tokens == a1 - a0
    assert r.usage.total_tokens == a1
    assert r.usage.completion_tokens_details.reasoning_tokens == n_tokens(s["tok"], "find ab\n")
    lps = [x.logprob for x in c.logprobs.content]
    assert len(lps) == a1 - a0 and all(x <= 0 for x in lps)
    assert "".join(x.token for x in c.logprobs.content) == script.texts[0]

    # the second turn, with the tool result: the final answer
    msgs = [
        *s["messages"][:2],
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    r2 = ask(
        s, msgs, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True}, logprobs=True
    )
    (b0, b1) = script.spans[1]
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "It is 42."
    assert r2.choices[0].message.model_extra["reasoning"] == "ok"
    assert r2.model_extra["prompt_token_ids"] == script.ids[:b0]
    assert [x.token for x in r2.choices[0].logprobs.content] == [f"token_id:{t}" for t in script.ids[b0:b1]]
    # without the extras the reply has none of them
    r3 = ask(s, s["messages"][:2])
    assert "prompt_token_ids" not in r3.model_extra and r3.choices[0].logprobs is None
    assert "token_ids" not in r3.choices[0].model_extra


def test_streaming_matches_non_streaming(served):
    s = served
    full = ask(s, s["messages"][:2], extra_body={"return_token_ids": True})
    chunks = list(
        ask(
            s,
            s["messages"][:2],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning") or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert reasoning == full.choices[0].message.model_extra["reasoning"]
    assert content == (full.choices[0].message.content or "")
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get", {"key": "ab"})
    ]
    assert finish == ["tool_calls"] and ids == full.choices[0].model_extra["token_ids"]
    assert chunks[0].model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def deltas(chunks, field):
    """The chunks' `field` deltas (reasoning or content), in order, empty ones left out."""
    out = []
    for ch in chunks:
        for c in ch.choices:
            d = c.delta.content if field == "content" else c.delta.model_extra.get(field)
            if d:
                out.append(d)
    return out


def answer_turn(s):
    """The scripted conversation up to its last turn (the answer "It is 42.")."""
    (call,) = s["messages"][2]["tool_calls"]
    call = {"id": "c1", **call, "function": {**call["function"], "arguments": json.dumps({"key": "ab"})}}
    return [
        *s["messages"][:2],
        {**s["messages"][2], "tool_calls": [call]},
        {**s["messages"][3], "tool_call_id": "c1"},
    ]


def test_stream_is_sent_as_the_tokens_are_sampled(served):
    """The answer turn and then random tokens (ignore_eos), 64 greedy tokens: the first text delta
    reaches the client while the engine is still decoding (its batch has not finished: the
    batcher's token count has not moved), text comes in many deltas each carrying its few token
    ids, and it all adds up to the non-stream reply of the same request."""
    s = served
    kw = dict(extra_body={"return_token_ids": True, "ignore_eos": True})
    msgs = answer_turn(s)
    stats = s["h"].service.batcher.stats
    before = stats.completion_tokens
    chunks, at_first = [], None
    for ch in ask(s, msgs, stream=True, stream_options={"include_usage": True}, **kw):
        if at_first is None and (deltas([ch], "reasoning") or deltas([ch], "content")):
            at_first = stats.completion_tokens  # read in this process, as the delta arrives
        chunks.append(ch)
    assert at_first == before, "the first delta came only after the whole turn was sampled"
    assert stats.completion_tokens == before + MAX_TOKENS
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    per_chunk = [len(c.model_extra.get("token_ids") or []) for ch in chunks for c in ch.choices]
    text = deltas(chunks, "reasoning") + deltas(chunks, "content")
    assert len(text) >= 8 and sum(per_chunk) == MAX_TOKENS, (text, per_chunk)
    full = ask(s, msgs, **kw).choices[0]
    assert "".join(deltas(chunks, "reasoning")) == (full.message.model_extra["reasoning"] or "")
    assert "".join(deltas(chunks, "content")) == (full.message.content or "")
    assert [t for ch in chunks for c in ch.choices for t in c.model_extra.get("token_ids") or []] == (
        full.model_extra["token_ids"]
    )
    assert chunks[-2].choices[0].finish_reason == full.finish_reason == "length"
    assert "reasoning_content" not in full.message.model_extra  # one name, vLLM's
    assert all("reasoning_content" not in c.delta.model_extra for ch in chunks for c in ch.choices)


def test_streamed_tool_call_turn_and_answer(served):
    """The scripted conversation streamed: the reasoning in more than one delta, the call in one
    tool_calls delta (id, name, whole arguments) once parsed, then the answer turn's content in
    several deltas."""
    s = served
    chunks = list(ask(s, s["messages"][:2], stream=True))
    assert len(deltas(chunks, "reasoning")) > 1 and "".join(deltas(chunks, "reasoning")) == "find ab"
    calls = [(i, tc) for i, ch in enumerate(chunks) for c in ch.choices for tc in c.delta.tool_calls or []]
    ((at, call),) = calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.index == 0
    assert call.function.name == "get" and json.loads(call.function.arguments) == {"key": "ab"}
    assert [ch.choices[0].finish_reason for ch in chunks[at + 1 :]] == ["tool_calls"]
    msgs = [
        *s["messages"][:2],
        {"role": "assistant", "content": None, "reasoning": "find ab", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    chunks = list(ask(s, msgs, stream=True))
    assert len(deltas(chunks, "content")) > 1 and "".join(deltas(chunks, "content")) == "It is 42."
    assert "".join(deltas(chunks, "reasoning")) == "ok"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chunked_decode_gives_the_tokens_of_one_call(served):
    """The engine's streaming loop (`interval` tokens per call, `on_tokens` per piece) samples
    exactly the tokens and log-probs of one decode call, and hands them over in order."""
    from jaxpi.rollout.engine import SamplingParams
    from jaxpi.serve.batcher import generate_keyed

    batcher = served["h"].service.batcher
    prompts = [served["script"].ids[:20], served["script"].ids[:33]]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_TOKENS, stop_token_ids=(7,))
    pieces = {0: [], 1: []}

    def on_tokens(i, ids, lps):
        assert 1 <= len(ids) <= 3 and len(ids) == len(lps)
        pieces[i].append((ids, lps))

    with batcher.engine_lock:
        whole = generate_keyed(batcher.engine, prompts, params, [5, 6])
        streamed = generate_keyed(batcher.engine, prompts, params, [5, 6], on_tokens, 3)
    for i, (a, b) in enumerate(zip(whole, streamed, strict=True)):
        assert a == b
        assert [t for ids, _ in pieces[i] for t in ids] == a.token_ids
        assert [x for _, lps in pieces[i] for x in lps] == a.logprobs
    assert len(pieces[0]) > 1


CALL = "<tool_call>\n<function=get>\n<parameter=key>\nab\n</parameter>\n</function>\n</tool_call>"
# Each piece is tokenised on its own: the split markers are plain-text tokens that join into a
# marker's text only when the next piece arrives.
PIECES = (
    *("find", " ab", "It", " is", " 42.", "é", "\n", "\n\n", " ", "<", "/"),
    *("<think>", "</think>", "<tool_call>", "</tool_call>", CALL, CALL.replace("=get", "=rm")),
    *(("</", "think>"), ("<tool", "_call>"), ("<|im", "_end|>"), ("<th", "ink>")),
)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    ends=st.booleans(),
    thinking_open=st.booleans(),
    cuts=st.lists(st.integers(1, 4), min_size=40, max_size=40),
)
def test_stream_deltas_add_up_to_the_non_stream_message(served, pieces, ends, thinking_open, cuts):
    """Any turn (markers in any order, calls good and bad, cut short or ended, fed a few ids at a
    time): the reasoning and content deltas concatenate to the non-stream message's fields, and
    the calls sent are its calls, except after a call the turn then spoils (documented)."""
    tok = served["tok"]
    fmt = ChatFormat(tok, RenderConfig(tokenizer_dir=str(served["ckpt"])))
    req = read_chat_request(
        {"messages": [{"role": "user", "content": "q"}], "tools": served["tools"]},
        served="",
        efforts=fmt.efforts,
        vocab_size=1 << 30,
    )
    texts = [t for p in pieces for t in ((p,) if isinstance(p, str) else p)]
    ids = [t for text in texts for t in fmt.encode(text)] + ([fmt.eot_id] if ends else [])
    ts, got, pos = TurnStream(fmt, req, thinking_open), [], 0
    for n in cuts:
        if pos >= len(ids):
            break
        got += ts.feed(ids[pos : pos + n])
        pos += n
    last, turn = ts.finish(ids, "stop" if ends else "length")
    got += last
    msg = turn.message
    assert "".join(d.get("reasoning", "") for d in got) == (msg["reasoning"] or "")
    assert "".join(d.get("content", "") for d in got) == (msg["content"] or "")
    sent = [(c["function"]["name"], c["function"]["arguments"]) for d in got for c in d.get("tool_calls", [])]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    assert sent == want or (not want and turn.finish_reason != "tool_calls" and has_raw_call(msg)), (
        sent,
        msg,
    )
    assert [d["tool_calls"][0]["index"] for d in got if "tool_calls" in d] == list(range(len(sent)))


def has_raw_call(msg):
    """The turn's calls did not parse as a whole: their text is in the content."""
    return "<tool_call>" in (msg["content"] or "")


def test_metrics_and_the_request_log(served, caplog):
    """/metrics parses as Prometheus text and counts requests by status, prompt and generated
    tokens and latencies; each request is one log line with its numbers."""
    s = served
    url = s["h"].url

    def scrape():
        r = httpx.get(url + "/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
        return {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(r.text)
            for x in fam.samples
        }

    def until(cond):  # the line and the counts land just after the answer's last byte
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)
        return cond()

    ok = ("jaxpi_requests_total", (("method", "POST"), ("path", "/v1/chat/completions"), ("status", "200")))
    missing = (
        "jaxpi_requests_total",
        (("method", "POST"), ("path", "/v1/chat/completions"), ("status", "404")),
    )
    hist = ("jaxpi_request_latency_seconds_count", (("path", "/v1/chat/completions"),))
    before = scrape()
    with caplog.at_level(logging.INFO, logger="jaxpi.serve"):
        r = ask(s, s["messages"][:2])
        bad = {"model": "gpt-9", "messages": [{"role": "user", "content": "q"}]}
        assert httpx.post(url + "/v1/chat/completions", json=bad, timeout=30).status_code == 404
        line = (
            f"POST /v1/chat/completions status=200 model=ckpt prompt_tokens={r.usage.prompt_tokens} "
            f"completion_tokens={r.usage.completion_tokens} latency_s="
        )
        lines = lambda: [x.getMessage() for x in caplog.records if x.name == "jaxpi.serve"]  # noqa: E731
        assert until(lambda: any(x.startswith(line) and x.endswith("stream=false") for x in lines())), lines()
        assert until(
            lambda: any(x.startswith("POST /v1/chat/completions status=404 model=- ") for x in lines())
        )
    assert until(lambda: scrape()[missing] - before.get(missing, 0) == 1)
    after = scrape()
    assert after[ok] - before.get(ok, 0) == 1 and after[hist] - before.get(hist, 0) == 2
    grew = lambda name: after[(name, ())] - before.get((name, ()), 0)  # noqa: E731
    assert grew("jaxpi_prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("jaxpi_generation_tokens_total") == r.usage.completion_tokens
    assert after[("jaxpi_requests_running", ())] == 1  # the scrape itself
    assert after[("jaxpi_rows_waiting", ())] == 0
    inf = ("jaxpi_request_latency_seconds_bucket", (("le", "+Inf"), ("path", "/v1/chat/completions")))
    assert after[inf] == after[hist]
    r = httpx.get(url + "/no/such/" + "x" * 50, timeout=30)
    assert r.status_code == 404 and until(
        lambda: (
            ("jaxpi_requests_total", (("method", "GET"), ("path", "other"), ("status", "404"))) in scrape()
        )
    )


def test_completions_logprobs_equal_the_trainer(served):
    s = served
    prompt = s["script"].ids[:40]
    body = {
        "model": "ckpt",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 5,
        "logprobs": 1,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = httpx.post(s["h"].url + "/v1/completions", json=body, timeout=120).json()
    (c,) = r["choices"]
    assert (
        c["prompt_token_ids"] == prompt
        and len(c["token_ids"]) == MAX_TOKENS
        and c["finish_reason"] == "length"
    )
    assert c["text"] == s["tok"].decode(c["token_ids"], skip_special_tokens=False)
    ids = jnp.asarray([prompt + c["token_ids"]], jnp.int32)
    trainer = np.asarray(jax.jit(sequence_logprobs)(s["model"], ids))[0, len(prompt) :]
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"], trainer, atol=TOL, rtol=0)
    assert r["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": MAX_TOKENS,
        "total_tokens": 40 + MAX_TOKENS,
    }
    # the same seed reproduces the same tokens
    again = httpx.post(s["h"].url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert again["token_ids"] == c["token_ids"]


def test_concurrent_requests_are_batched(served):
    """Two greedy and two seeded requests at once: at most one engine call per sampling setting,
    and every result equal to the same request sent alone (keys follow the seed, not the row)."""
    s = served
    url = s["h"].url + "/v1/completions"
    prompts = [s["script"].ids[: 30 + 7 * i] for i in range(4)]
    extra = [
        {"temperature": 0},
        {"temperature": 0},
        {"temperature": 1.0, "seed": 11},
        {"temperature": 1.0, "seed": 12},
    ]

    def one(i):
        body = {
            "prompt": prompts[i],
            "max_tokens": MAX_TOKENS,
            "return_token_ids": True,
            "logprobs": 0,
            **extra[i],
        }
        return httpx.post(url, json=body, timeout=300).json()["choices"][0]

    alone = [one(i) for i in range(4)]
    before = httpx.get(s["h"].url + "/jaxpi/stats").json()
    together = [None] * 4

    def run(i):
        together[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = httpx.get(s["h"].url + "/jaxpi/stats").json()
    assert after["requests"] - before["requests"] == 4 and after["rows"] - before["rows"] == 4
    assert after["engine_calls"] - before["engine_calls"] <= 2 and after["batched_rows_max"] >= 2
    for a, b in zip(alone, together, strict=True):
        assert a["token_ids"] == b["token_ids"]
        np.testing.assert_allclose(
            a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], atol=1e-6
        )
    assert alone[2]["token_ids"] != alone[3]["token_ids"]  # different seeds, different samples


def test_bad_requests_get_400_naming_the_problem(served):
    s = served
    url = s["h"].url + "/v1/chat/completions"
    cases = [
        (b"{not json", "not valid JSON"),
        (json.dumps({"model": "ckpt"}).encode(), "'messages' is required"),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(), "messages[0].role"),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"}).encode(),
            "reasoning_effort",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
            "temperature",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x " * 400}]}).encode(),
            "context limit is 512",
        ),
    ]
    for raw, needle in cases:
        r = httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (needle, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400
        assert set(err) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match="context limit"):
        ask(s, [{"role": "user", "content": "x " * 400}])
    r = httpx.post(s["h"].url + "/v1/completions", json={"prompt": [1, 2, 999]}, timeout=60)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.get(s["h"].url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    models = s["client"].models.list()
    assert [m.id for m in models.data] == ["ckpt"]


def test_turn_parsing_to_messages(served):
    tok = served["tok"]
    fmt = ChatFormat(tok, RenderConfig(tokenizer_dir=str(served["ckpt"])))
    req = read_chat_request(
        {"messages": [{"role": "user", "content": "q"}], "tools": served["tools"]},
        served="",
        efforts=fmt.efforts,
        vocab_size=512,
    )
    enc = fmt.encode
    call = "<tool_call>\n<function=get>\n<parameter=key>\nx y\n</parameter>\n</function>\n</tool_call>"
    t = fmt.turn(req, enc(f"plan\n</think>\n\nLooking.\n\n{call}<|im_end|>"), "stop", True)
    assert t.finish_reason == "tool_calls" and t.message["content"] == "Looking."
    assert t.message["reasoning"] == "plan"
    assert json.loads(t.message["tool_calls"][0]["function"]["arguments"]) == {"key": "x y"}
    assert t.reasoning_tokens == n_tokens(tok, "plan\n")
    # an unknown tool is not a call: the text comes back as content, with the parse error kept
    bad = call.replace("=get", "=rm")
    t = fmt.turn(req, enc(f"p\n</think>\n\n{bad}<|im_end|>"), "stop", True)
    assert t.finish_reason == "stop" and "tool_calls" not in t.message and t.message["content"] == bad
    assert "unknown tool 'rm'" in t.parse_error
    # cut short inside the thinking block: all reasoning, finish "length"
    t = fmt.turn(req, enc("still thinking"), "length", True)
    assert (t.finish_reason, t.message["reasoning"], t.message["content"]) == (
        "length",
        "still thinking",
        "",
    )
    assert t.reasoning_tokens == n_tokens(tok, "still thinking")


def test_cli_serves_and_stops_on_sigterm(served):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXPI_API_KEY": "k-serve"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpi.cli",
            "serve",
            "--model",
            str(served["ckpt"]),
            "--port",
            "0",
            "--json",
            "--max-len",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.poll() is not None else "no output"
        info = json.loads(line)
        assert info["pid"] == p.pid
        assert httpx.get(info["url"] + "/health", timeout=10).json()["status"] == "ok"
        # The key came from $JAXPI_API_KEY: without it 401, with it the model list.
        assert httpx.get(info["url"] + "/v1/models", timeout=10).status_code == 401
        key = {"Authorization": "Bearer k-serve"}
        models = httpx.get(info["url"] + "/v1/models", headers=key, timeout=10).json()
        assert models["data"][0]["id"] == "ckpt"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_serve_flags_map_onto_the_config(monkeypatch):
    import argparse

    from jaxpi.cli.serve import add_subparser, serve_config

    parser = argparse.ArgumentParser()
    add_subparser(parser.add_subparsers())

    def cfg(*argv):
        return serve_config(parser.parse_args(["serve", "--model", "m", *argv]))

    monkeypatch.delenv("JAXPI_API_KEY", raising=False)
    c = cfg()
    assert (c.api_key, c.read_timeout_s, c.limits.max_body_bytes, c.max_connections, c.http_workers) == (
        None,
        30.0,
        64 * 2**20,
        512,
        128,
    )
    c = cfg("--api-key", "k1", "--read-timeout", "2.5", "--max-request-mb", "1", "--max-connections", "9")
    assert (c.api_key, c.limits.read_timeout_s, c.limits.max_body_bytes, c.limits.max_connections) == (
        "k1",
        2.5,
        2**20,
        9,
    )
    assert "k1" not in repr(c)  # a key never lands in a log line
    assert cfg().stream_interval == 1 and cfg("--stream-interval", "4").stream_interval == 4
    monkeypatch.setenv("JAXPI_API_KEY", "k-env")
    assert cfg().api_key == "k-env" and cfg("--api-key", "k1").api_key == "k1"
    for argv, needle in [
        (("--read-timeout", "0"), "read_timeout_s"),
        (("--max-connections", "0"), "max_connections"),
        (("--http-workers", "0"), "http_workers"),
        (("--max-request-mb", "-1"), "max_request_mb"),
        (("--api-key", "two words"), "api_key"),
        (("--stream-interval", "0"), "stream_interval"),
    ]:
        with pytest.raises(ValueError, match=needle):
            cfg(*argv)


def test_peft_and_orbax_adapters_are_loaded_onto_the_base(served, tmp_path):
    from flax import nnx

    from jaxpi import load_hf
    from jaxpi.hf_fixtures import seeded_noise
    from jaxpi.lora import LoraConfig, LoRAParam, add_lora
    from jaxpi.lora.peft import save_peft
    from jaxpi.serve.loading import load_served_model

    ckpt = served["ckpt"]
    _, m = load_hf(ckpt)
    lcfg = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    add_lora(m, lcfg, key=jax.random.key(1))
    nnx.update(m, seeded_noise(nnx.state(m, LoRAParam), seed=3))  # B non-zero: a real adapter
    peft_dir = save_peft(m, lcfg, tmp_path / "peft", base_dir=ckpt)
    loaded = load_served_model(ServeConfig(model=str(ckpt), adapter=str(peft_dir)))
    assert loaded.adapters == (str(peft_dir),) and loaded.tokenizer_dir == ckpt
    want = jax.tree.leaves(nnx.state(m, LoRAParam))
    got = jax.tree.leaves(nnx.state(loaded.model, LoRAParam))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # the same adapter as a jaxpi (orbax) run directory: --model RUN_DIR finds base and tokenizer
    from jaxpi.configfile import to_dict
    from jaxpi.train.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path / "run", keep=1)
    meta = {
        "base": str(ckpt),
        "model_config": m.cfg.to_hf(),
        "lora": to_dict(lcfg),
        "tokenizer": str(ckpt),
        "config": {},
    }
    store.save(1, nnx.state(m, LoRAParam), {"mu": jnp.zeros(())}, {"step": 1}, meta)
    store.close()
    run = load_served_model(ServeConfig(model=str(tmp_path / "run")))
    assert run.base_dir == ckpt and run.tokenizer_dir == ckpt
    for a, b in zip(jax.tree.leaves(nnx.state(run.model, LoRAParam)), want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    with pytest.raises(FileNotFoundError, match="--adapter"):
        load_served_model(ServeConfig(model=str(ckpt), adapter=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="neither a PEFT adapter"):
        load_served_model(ServeConfig(model=str(ckpt), adapter=str(tmp_path)))


def test_unknown_model_is_404_and_max_tokens_over_the_context_is_400(served):
    """As vLLM and OpenAI answer: an unknown model is 404 NotFoundError; max_tokens beyond the
    context the prompt leaves is refused (400, the limit named), not clamped; no max_tokens
    means the server's default within that context."""
    s = served
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        body = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "prompt": [1, 2]}
        r = httpx.post(s["h"].url + endpoint, json=body, timeout=60)
        assert r.status_code == 404, r.text
        assert r.json() == {
            "error": {
                "message": 'The model "gpt-9" does not exist; this server serves "ckpt"',
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        s["client"].chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "q"}])
    with pytest.raises(openai.BadRequestError) as e:
        s["client"].chat.completions.create(
            model="ckpt", messages=[{"role": "user", "content": "q"}], max_tokens=100_000
        )
    err = e.value.body
    assert err["type"] == "BadRequestError" and err["param"] == "max_tokens" and err["code"] == 400
    assert "100000" in err["message"] and "context limit is 512" in err["message"]
    long = [10 + i % 400 for i in range(512 - MAX_TOKENS)]
    r = httpx.post(
        s["h"].url + "/v1/completions", json={"prompt": long, "max_tokens": MAX_TOKENS + 1}, timeout=60
    )
    assert r.status_code == 400 and f"{MAX_TOKENS + 1} > 512 - {len(long)}" in r.json()["error"]["message"]
    # at the limit, and without max_tokens (the default, within the context left): served
    service = s["h"].service
    req = read_chat_request(
        {"messages": [{"role": "user", "content": "q"}]},
        served="",
        efforts=service.fmt.efforts,
        vocab_size=512,
    )
    assert req.sampling.max_tokens is None
    (row,) = service._rows(list(range(500)), req.sampling, (2,), service.max_new_tokens)
    assert row.params.max_new_tokens == 12 and row.params.stop_token_ids == (2,)
    r = httpx.post(
        s["h"].url + "/v1/completions",
        json={"prompt": long, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
