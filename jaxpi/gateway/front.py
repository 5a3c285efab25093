"""The recording gateway in front of an upstream OpenAI-compatible server, as the callers that run
Pi attempts use it (`jaxpi eval`'s policy endpoint, the GRPO Pi collector): one token per attempt,
and the attempt's call records with their token counts once it is over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from jaxpi.gateway.proxy import start_gateway
from jaxpi.runner.attempt import KeyFn, TraceFn


@contextlib.contextmanager
def gateway_in_front(
    upstream: str, record_dir: str | None = None, host: str = "127.0.0.1"
) -> Iterator[tuple[str, TraceFn, KeyFn, Any]]:
    """The recording gateway in front of `upstream`, listening on `host` (another machine's
    Pi attempts need an address of this one they can reach): (its URL, attempt id -> call
    records, attempt id -> a new token for it, the handle)."""
    gw = start_gateway(upstream, record_dir=record_dir, host=host)
    try:

        def key(attempt_id: str) -> str:
            return gw.gateway.open_attempt(attempt_id)[1]

        def trace(attempt_id: str) -> Sequence[dict] | None:
            gw.gateway.close_attempt(attempt_id)  # the attempt is over: nothing may add to it now
            recs = gw.gateway.store.get(attempt_id)
            return None if recs is None else [call_record(r) for r in recs]

        yield gw.url, trace, key, gw
    finally:
        gw.close()


def call_record(rec: dict) -> dict:
    """A gateway record with its token counts flat (`completion_tokens`, `reasoning_tokens`; None
    for a failed call), as the runner sums them."""
    ids = rec.get("completion_token_ids")
    usage = rec.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    return {
        **rec,
        "completion_tokens": len(ids) if isinstance(ids, list) else None,
        "reasoning_tokens": details.get("reasoning_tokens") if ids is not None else None,
    }
