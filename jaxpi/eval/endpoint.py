"""The policy endpoint Pi talks to: `jaxpi serve` on a checkpoint with the recording gateway in
front, or an endpoint someone else runs.

    with policy_endpoint(model="runs/sft/checkpoints/24") as ep:
        ep.url        # http://127.0.0.1:PORT/v1 (the gateway's, when it runs)
        ep.model_id   # the served model name Pi asks for
        ep.key(id)    # the API key Pi sends for attempt `id`: a token the gateway issues
        ep.trace(id)  # the gateway's call records of one attempt (None without a gateway)

Attempt ids are the caller's names; the gateway files a call under an attempt only by its token,
so a sandboxed attempt cannot read or append to another's records. `trace(id)` closes the
attempt first (its token stops working), then reads its records.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from jaxpi.gateway.front import gateway_in_front
from jaxpi.runner.attempt import KeyFn, TraceFn


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str  # base URL ending in /v1
    model_id: str
    trace: TraceFn | None = None
    key: KeyFn | None = None  # attempt id -> the API key Pi sends (None: the attempt id)
    gateway: Any = None  # the gateway handle, when we started one
    server: Any = None  # the serve handle, when we started one


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@contextlib.contextmanager
def policy_endpoint(
    *,
    model: str | None = None,
    adapter: str | None = None,
    endpoint: str | None = None,
    model_id: str | None = None,
    api_key: str | None = None,
    max_len: int = 8192,
    max_new_tokens: int = 2048,
    batch: int = 2,
    seed: int = 0,
) -> Iterator[Endpoint]:
    """Serve `model` (+ `adapter`) behind the gateway for the duration, or wrap `endpoint` (whose
    `--api-key`, if it has one, is `api_key`: Pi sends it for every attempt)."""
    if endpoint is not None:
        key = (lambda _: api_key) if api_key else None
        yield Endpoint(url=_v1(endpoint), model_id=model_id or "policy", key=key)
        return
    if model is None:
        raise ValueError("policy_endpoint: give a model to serve or an endpoint")
    from jaxpi.serve import ServeConfig, start_server

    cfg = ServeConfig(
        model=model,
        adapter=adapter,
        served_name="policy",  # the name Pi's models.json asks for, whatever the directory is called
        port=0,  # a free port: several evaluations may run on one machine
        max_batch=batch,
        max_len=max_len,
        max_new_tokens=min(max_new_tokens, max_len - 1),
        seed=seed,
    )
    server = start_server(cfg)
    try:
        with gateway_in_front(server.url) as (url, trace, key, gw):
            yield Endpoint(url=_v1(url), model_id=cfg.name, trace=trace, key=key, gateway=gw, server=server)
    finally:
        server.close()
