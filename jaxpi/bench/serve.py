"""Latency of `jaxpi serve` and of the gateway in front of it, on a tiny scripted checkpoint.

    jaxpi bench serve [--out DIR] [--requests N] [--json]      (or python -m jaxpi.bench.serve)

Builds the tiny checkpoint of the tests (random weights, head solved to replay the lookup
script), serves it on a free port, puts a gateway in front, and times (after one warm-up request
that compiles the programs): a chat tool-call turn direct and through the gateway (non-streaming
and streaming), a 64-token token-id completion, N concurrent completions (batched), and a
keep-alive GET /health (the HTTP front alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _timed(fn: Any, n: int) -> dict[str, float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(ts), 4), "min_s": round(min(ts), 4), "n": n}


def run(out: Path, requests: int = 4, repeats: int = 5) -> dict[str, Any]:
    import httpx

    from jaxpi.config import TINY
    from jaxpi.convert.tiny import make_checkpoint
    from jaxpi.gateway import start_gateway
    from jaxpi.serve import ServeConfig, start_server
    from jaxpi.serve.loading import Loaded
    from jaxpi.testing.scripted import lookup_script, scripted_model

    t0 = time.perf_counter()
    ckpt = out / "ckpt"
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, TINY.replace(hidden_size=128, intermediate_size=256), seed=2, tokenizer=True)
    messages, tools, effort = lookup_script()
    model, script = scripted_model(ckpt, messages, tools, effort)
    cfg = ServeConfig(
        model=str(ckpt), port=0, max_len=512, max_new_tokens=64, max_batch=requests, prefill_chunks=(64, 1)
    )
    server = start_server(cfg, loaded=Loaded(model, ckpt, ckpt, ()))
    gw = start_gateway(server.url, port=0, record_dir=str(out / "records"))
    setup_s = time.perf_counter() - t0
    chat = {
        "model": "ckpt",
        "messages": messages[:2],
        "tools": tools,
        "reasoning_effort": effort,
        "temperature": 0,
        "max_tokens": 64,
    }
    comp = {
        "prompt": script.ids[:200],
        "max_tokens": 64,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    _, token = gw.gateway.open_attempt("bench")  # the gateway files the calls under this attempt
    c = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {token}"})
    try:
        t1 = time.perf_counter()
        c.post(server.url + "/v1/chat/completions", json=chat).raise_for_status()
        c.post(server.url + "/v1/completions", json=comp).raise_for_status()
        first_s = time.perf_counter() - t1  # compiles prefill and decode programs

        def post(url: str, body: dict) -> None:
            c.post(url, json=body).raise_for_status()

        res = {
            "setup_s": round(setup_s, 2),
            "first_requests_s": round(first_s, 2),
            "chat_direct": _timed(lambda: post(server.url + "/v1/chat/completions", chat), repeats),
            "chat_gateway": _timed(lambda: post(gw.url + "/v1/chat/completions", chat), repeats),
            "chat_gateway_stream": _timed(
                lambda: post(gw.url + "/v1/chat/completions", {**chat, "stream": True}), repeats
            ),
            "completion_64": _timed(lambda: post(server.url + "/v1/completions", comp), repeats),
            # The HTTP front alone: a keep-alive request that never reaches the engine.
            "health_keepalive": _timed(lambda: c.get(server.url + "/health").raise_for_status(), 50),
        }

        def concurrent() -> None:
            ts = [
                threading.Thread(target=post, args=(server.url + "/v1/completions", {**comp, "seed": i}))
                for i in range(requests)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        before = c.get(server.url + "/jaxpi/stats").json()
        res[f"completions_64_x{requests}_concurrent"] = _timed(concurrent, repeats)
        after = c.get(server.url + "/jaxpi/stats").json()
        res["engine_calls_per_concurrent_batch"] = (after["engine_calls"] - before["engine_calls"]) / repeats
        res["tool_call_tokens"] = script.spans[0][1] - script.spans[0][0]
        return res
    finally:
        c.close()
        gw.close()
        server.close()


HELP = __doc__.split("\n\n")[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="where the checkpoint and records go (default: a temp dir)")
    p.add_argument("--requests", type=int, default=4, help="concurrent completions (and engine rows)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpi.bench.serve", description=HELP)
    add_arguments(p)
    return cmd_serve(p.parse_args(argv))


def cmd_serve(args: argparse.Namespace) -> int:
    """`jaxpi bench serve` / `python -m jaxpi.bench.serve`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        res = run(out, args.requests, args.repeats)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:40s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
