"""Talking to the upstream server (vLLM or `jaxpi serve`): what the gateway adds, strips and checks.

The gateway always calls upstream **non-streaming** with `return_token_ids` and `logprobs` on, and
re-streams the finished reply to clients that asked for a stream. One JSON reply then carries
the prompt token ids, the completion token ids and their logprobs together, with the same code
for either upstream; the price is that a streaming client sees its first byte only when the turn
is done (`jaxpi serve` produces whole turns anyway).
"""

from __future__ import annotations

import copy
import math
from typing import Any

# Request fields the gateway sets upstream, and the client's own values to restore in its view.
EXTRAS = ("return_token_ids", "logprobs")


class UpstreamError(Exception):
    """A failed upstream call as the client will see it: status 502/504 (or upstream's 4xx)."""

    def __init__(self, status: int, kind: str, message: str, body: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.body = status, kind, message, body

    def record(self) -> dict[str, Any]:
        return {"status": self.status, "type": self.kind, "message": self.message}


def upstream_body(client_body: dict[str, Any]) -> dict[str, Any]:
    """The request sent upstream: token ids and logprobs of the sampled tokens asked for, no stream."""
    body = copy.deepcopy(client_body)
    body["return_token_ids"] = True
    body["logprobs"] = True
    body["stream"] = False
    body.pop("stream_options", None)
    return body


def client_view(reply: dict[str, Any], client_body: dict[str, Any]) -> dict[str, Any]:
    """Upstream's reply without what only the gateway asked for."""
    out = copy.deepcopy(reply)
    want_ids, want_lp = bool(client_body.get("return_token_ids")), bool(client_body.get("logprobs"))
    if not want_ids:
        out.pop("prompt_token_ids", None)
    for c in out.get("choices", []):
        if not want_ids:
            c.pop("token_ids", None)
        if not want_lp:
            c["logprobs"] = None
    return out


def check_reply(reply: Any) -> dict[str, Any]:
    """The recorded fields of choice 0, or UpstreamError(502) naming what is missing or wrong."""

    def malformed(why: str) -> UpstreamError:
        return UpstreamError(502, "upstream_malformed", f"malformed upstream reply: {why}")

    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise malformed("no choices")
    c = reply["choices"][0]
    if not isinstance(c, dict) or not isinstance(c.get("message"), dict):
        raise malformed("choice 0 has no message")
    prompt, ids = reply.get("prompt_token_ids"), c.get("token_ids")
    for name, v in (("prompt_token_ids", prompt), ("choices[0].token_ids", ids)):
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise malformed(f"{name} missing or not a list of ints (does upstream support return_token_ids?)")
    content = (c.get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        raise malformed("choices[0].logprobs.content missing")
    lps = [e.get("logprob") if isinstance(e, dict) else None for e in content]
    # One logprob per sampled id, or the trainer would weight the wrong tokens.
    if len(lps) != len(ids) or not all(isinstance(x, int | float) and not math.isnan(x) for x in lps):
        raise malformed(f"{len(lps)} logprobs for {len(ids)} completion tokens")
    if c.get("finish_reason") not in ("stop", "length", "tool_calls"):
        raise malformed(f"finish_reason {c.get('finish_reason')!r}")
    return {
        "prompt_token_ids": prompt,
        "completion_token_ids": ids,
        "logprobs": [float(x) for x in lps],
        "finish_reason": c["finish_reason"],
        "message": c["message"],
        "usage": reply.get("usage"),
    }


def post(client: Any, url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST JSON upstream; transport failures, 5xx and non-JSON become UpstreamError."""
    import httpx

    try:
        r = client.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as e:
        raise UpstreamError(
            504, "upstream_timeout", f"upstream did not answer within {timeout} s: {e}"
        ) from None
    except httpx.HTTPError as e:
        raise UpstreamError(
            502, "upstream_unreachable", f"upstream {url} unreachable: {type(e).__name__}: {e}"
        ) from None
    try:
        data = r.json()
    except ValueError:
        raise UpstreamError(
            502, "upstream_malformed", f"upstream answered {r.status_code} with non-JSON"
        ) from None
    if r.status_code >= 500:
        raise UpstreamError(502, "upstream_error", f"upstream answered {r.status_code}: {str(data)[:500]}")
    if r.status_code >= 400:  # the client's own mistake: its status and upstream's message, unchanged
        msg = None
        if isinstance(
            data, dict
        ):  # {"error": {...}} (OpenAI, new vLLM) or a flat {"message": ...} (old vLLM)
            err = data.get("error")
            msg = err.get("message") if isinstance(err, dict) else data.get("message")
        raise UpstreamError(r.status_code, "upstream_rejected", str(msg or data)[:500], body=data)
    return data
