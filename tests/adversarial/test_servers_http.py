"""Hostile clients against the HTTP front that `jaxpi serve` and `jaxpi gateway` share: bad or
negative Content-Length, bodies over the limit, half-sent and stalled requests (one and 200 at
once), malformed request lines and headers, and requests without the API key.

Both servers run for real on loopback: `jaxpi serve` on a tiny random model (no request here
reaches the engine, so nothing compiles), the gateway in front of an upstream that is never asked.
Each probe must get a 4xx OpenAI error object, `{"error": {"message", "type", "code"}}`, and
leave the server answering others.
"""

import http.client
import json
import select
import socket
import threading
import time
import urllib.parse

import httpx
import pytest

from jaxpi import TINY
from jaxpi.data.tiny_tokenizer import ASSETS
from jaxpi.gateway import start_gateway
from jaxpi.hf_fixtures import random_jax_model
from jaxpi.serve import ServeConfig, start_server
from jaxpi.serve.loading import Loaded

KEY = "sk-test-0123456789"
READ_TIMEOUT = 1.0
MAX_REQUEST_MB = 0.01  # 10,485 bytes


@pytest.fixture(scope="module")
def serve():
    tok = ASSETS / "tiny_tokenizer"
    cfg = ServeConfig(
        model="tiny",
        port=0,
        max_len=64,
        max_new_tokens=8,
        max_batch=1,
        prefill_chunks=(1,),
        api_key=KEY,
        read_timeout_s=READ_TIMEOUT,
        max_request_mb=MAX_REQUEST_MB,
        max_connections=256,
        http_workers=8,
    )
    h = start_server(cfg, loaded=Loaded(random_jax_model(TINY), tok, tok, ()))
    yield h
    h.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    h = start_gateway(
        "http://127.0.0.1:9",  # nothing listens: no probe here may reach upstream
        record_dir=str(tmp_path_factory.mktemp("records")),
        api_key=KEY,
        read_timeout_s=READ_TIMEOUT,
        max_request_mb=MAX_REQUEST_MB,
        max_connections=256,
        http_workers=8,
    )
    yield h
    h.close()


@pytest.fixture(params=["serve", "gateway"])
def server(request):
    return request.getfixturevalue(request.param)


def address(url):
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port


def exchange(url, data, timeout=10.0):
    """Send raw bytes, read one response: (status, headers, body bytes)."""
    with socket.create_connection(address(url), timeout=timeout) as s:
        s.sendall(data)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, dict(r.getheaders()), r.read()


def assert_error_json(status, headers, body, lo=400, hi=499):
    assert lo <= status <= hi, (status, body[:300])
    assert headers.get("Content-Type") == "application/json", headers
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "code" in err
    assert "Traceback" not in err["message"]
    return err


def post_head(path, length, extra=""):
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def healthy(url):
    return httpx.get(url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("length", ["abc", "-1", "+5", "1e3", " ", "0x10", "5, 6", "99999999999999999999999"])
def test_a_content_length_that_is_not_a_size_is_400(server, length):
    status, headers, body = exchange(server.url, post_head("/v1/chat/completions", length) + b"{}")
    err = assert_error_json(status, headers, body, 400, 413)
    assert "Content-Length" in err["message"] or status == 413
    assert healthy(server.url)


def test_two_different_content_lengths_are_400(server):
    head = post_head("/v1/chat/completions", 2, "Content-Length: 3\r\n")
    status, headers, body = exchange(server.url, head + b"{}")
    assert status == 400 and "Content-Length" in assert_error_json(status, headers, body)["message"]


def test_a_body_over_the_limit_is_413_and_not_read(server):
    n = int(MAX_REQUEST_MB * 2**20) + 1
    t0 = time.monotonic()
    # Only the head is sent: the answer must not wait for (or need) a body over the limit.
    status, headers, body = exchange(server.url, post_head("/v1/chat/completions", n))
    assert status == 413 and time.monotonic() - t0 < READ_TIMEOUT
    assert str(int(MAX_REQUEST_MB * 2**20)) in assert_error_json(status, headers, body)["message"]
    # The same over the wire with the whole body (the client sends before it reads).
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"x" * n,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert healthy(server.url)


@pytest.mark.parametrize("what", ["head", "body"])
def test_a_half_sent_request_is_answered_408_after_the_read_timeout(server, what):
    data = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"
    if what == "body":
        data = post_head("/v1/chat/completions", 100) + b'{"messages": ['
    t0 = time.monotonic()
    status, headers, body = exchange(server.url, data, timeout=READ_TIMEOUT + 5)
    waited = time.monotonic() - t0
    assert status == 408 and READ_TIMEOUT * 0.8 <= waited < READ_TIMEOUT + 3, (status, waited)
    assert_error_json(status, headers, body)
    assert headers.get("Connection") == "close"


def test_a_trickled_request_is_cut_at_the_read_timeout(server):
    """One byte every 0.2 s never lets a per-read timeout fire: the deadline is per request."""
    answer = b""
    with socket.create_connection(address(server.url), timeout=READ_TIMEOUT + 5) as s:
        t0 = time.monotonic()
        for b in post_head("/v1/chat/completions", 100):  # ~150 bytes: 30 s if never cut
            if select.select([s], [], [], 0.2)[0]:
                answer = s.recv(65536)
                break
            s.sendall(bytes([b]))
        waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408") and waited < READ_TIMEOUT + 2, (answer[:100], waited)


def test_200_half_sent_requests_hold_no_thread_and_a_normal_request_is_served(server):
    threads_before = threading.active_count()
    socks = []
    try:
        for i in range(200):
            s = socket.create_connection(address(server.url), timeout=READ_TIMEOUT + 5)
            s.sendall(post_head("/v1/chat/completions", 1000) + b'{"mess' if i % 2 else b"GET /heal")
            socks.append(s)
        time.sleep(0.2)
        # While they hang: a normal request gets its answer at once, and they cost no threads.
        t0 = time.monotonic()
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        assert r.status_code in (200, 502) and time.monotonic() - t0 < 1.0  # the gateway's upstream is down
        assert threading.active_count() - threads_before < 20
        # And after the read timeout the server has let every one of them go.
        deadline = time.monotonic() + READ_TIMEOUT + 5
        for s in socks:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            got = s.recv(65536)
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:100]
    finally:
        for s in socks:
            s.close()
    assert healthy(server.url)


def test_a_connection_over_the_cap_is_503_json(tmp_path):
    # A small cap on a server of its own: the shared ones allow 256.
    h = start_gateway(
        "http://127.0.0.1:9", record_dir=str(tmp_path), max_connections=4, read_timeout_s=READ_TIMEOUT
    )
    socks = []
    try:
        for _ in range(4):
            socks.append(socket.create_connection(address(h.url), timeout=5))
            socks[-1].sendall(b"GET /heal")
        time.sleep(0.2)
        status, headers, body = exchange(h.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (
            status == 503 and "connections" in assert_error_json(status, headers, body, 503, 503)["message"]
        )
        for s in socks:
            s.close()
        time.sleep(0.2)
        assert healthy(h.url)  # closed connections free their places
    finally:
        for s in socks:
            s.close()
        h.close()


MALFORMED = {
    "garbage request line": b"HELLO\r\n\r\n",
    "unknown HTTP version": b"GET /health HTTP/9.9\r\n\r\n",
    "bad version string": b"GET /health HTTX/1.1\r\n\r\n",
    "unknown method": b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "request line too long": b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    "header too long": b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n",
    "too many headers": b"GET /health HTTP/1.1\r\n"
    + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
    + b"\r\n",
    "chunked body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "body not JSON": post_head("/v1/chat/completions", 5) + b"{oops",
    "body not UTF-8": post_head("/v1/chat/completions", 4) + b"\xff\xfe\x00{",
    "body a JSON list": post_head("/v1/chat/completions", 2) + b"[]",
    "body a JSON number": post_head("/v1/chat/completions", 1) + b"7",
    # under the size limit, yet deep enough to break a recursive parser
    "deeply nested body": post_head("/v1/chat/completions", 6000) + b"[" * 3000 + b"]" * 3000,
    "no body": post_head("/v1/chat/completions", 0),
    "unknown route": b"GET /etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_gets_4xx_json(server, case):
    status, headers, body = exchange(server.url, MALFORMED[case])
    assert_error_json(status, headers, body)
    assert healthy(server.url)


def test_serve_requires_its_api_key(serve):
    url = serve.url
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic " + KEY},
    ):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/jaxpi/stats"),
        ):
            r = httpx.request(method, url + path, headers=headers, json={}, timeout=5)
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "AuthenticationError"
            assert r.headers.get("WWW-Authenticate", "").startswith("Bearer")
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
    assert httpx.get(url + "/health", timeout=5).status_code == 200  # as vLLM: health needs no key
