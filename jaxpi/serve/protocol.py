"""The OpenAI wire format, as vLLM's server speaks it: request validation and response shapes.

Pure functions over JSON-like dicts; nothing here touches the model or the network. Field names
follow vLLM's OpenAI server exactly, so a client (or `jaxpi gateway`) works against either:

    request extensions   return_token_ids, return_tokens_as_token_ids, stop_token_ids,
                         ignore_eos, reasoning_effort, chat_template_kwargs
    chat response        top-level prompt_token_ids; per choice token_ids, logprobs.content[i]
                         {token, logprob, bytes, top_logprobs}; message.reasoning (vLLM's current
                         name, stream deltas too; requests may send the old reasoning_content);
                         usage.completion_tokens_details
    completions          per choice text, token_ids, prompt_token_ids, logprobs {tokens,
                         token_logprobs, top_logprobs, text_offset}
    errors               {"error": {message, type, param, code}}: `type` named by the status
                         (vLLM's names: BadRequestError, NotFoundError, InternalServerError, ...),
                         `code` the status (401: OpenAI's "invalid_api_key")
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
EFFORT_ALIASES = {"none": "off"}  # OpenAI's "none" is Pi's "off" (thinking disabled)


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    411: "LengthRequiredError",
    413: "RequestTooLargeError",
    414: "URITooLongError",
    429: "RateLimitError",
    431: "HeadersTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The error object's `type` for an HTTP status: vLLM's names (and the openai client's
    exception names) where they exist, the status's own name otherwise."""
    return ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


class ApiError(Exception):
    """A request the server refuses; `body()` is OpenAI's error object. `kind` (the `type`)
    defaults to `error_type(status)`, `code` to the status; `headers` go out with the answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        code: int | str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = error_type(status) if kind is None else kind
        self.code = status if code is None else code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def status_error(status: int, message: str) -> dict:
    """The error object of a refusal with nothing more to say than its status and message."""
    return error_body(message, error_type(status), None, status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# ---- field readers (each names the field it rejects) ---------------------------------------------
def _number(body: Mapping, key: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"'{key}' must be a number, got {json.dumps(v)}", key)
    if not (lo < v <= hi if open_lo else lo <= v <= hi):
        raise bad(f"'{key}' must be in {'(' if open_lo else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _int(body: Mapping, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer, got {json.dumps(v)}", key)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"'{key}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", key)
    return v


def _bool(body: Mapping, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, got {json.dumps(v)}", key)
    return v


def _token_ids(v: Any, key: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise bad(f"'{key}' must be a list of token ids", key)
    out_of_range = [t for t in v if not 0 <= t < vocab_size]
    if out_of_range:
        raise bad(f"'{key}': token ids {out_of_range[:5]} outside the vocabulary [0, {vocab_size})", key)
    return list(v)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling fields shared by both endpoints (seed None: the server draws one;
    max_tokens None: the server's default, within the context left)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    n: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


def read_sampling(body: Mapping, *, vocab_size: int) -> Sampling:
    if body.get("prompt_logprobs") is not None:
        raise bad("'prompt_logprobs' is not supported by jaxpi serve", "prompt_logprobs")
    if body.get("stop"):
        raise bad("'stop' strings are not supported by jaxpi serve; use 'stop_token_ids'", "stop")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    return Sampling(
        max_tokens=_int({"max_tokens": mt}, "max_tokens", None, 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        n=int(_int(body, "n", 1, 1, 16)),  # type: ignore[arg-type]
        stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab_size)),
        ignore_eos=_bool(body, "ignore_eos"),
    )


def check_model(body: Mapping, served: str) -> None:
    """An unknown model is 404 NotFoundError, as vLLM and OpenAI answer."""
    model = body.get("model")
    if model is not None and model != served:
        shown = json.dumps(model)[:200]
        raise ApiError(
            404, f"The model {shown} does not exist; this server serves {json.dumps(served)}", param="model"
        )


# ---- chat ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict, ...]  # template-ready: tool-call arguments as dicts, reasoning_content
    tools: tuple[dict, ...]
    effort: str | None  # a level of the render config (None: its default)
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    tokens_as_ids: bool
    template_kwargs: Mapping[str, Any]


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, null, or a list of {"type": "text", "text": ...} parts,
    joined by newlines (as vLLM joins them, and as the session reader joins Pi's text blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}.content[{j}]: only text parts are supported", "messages")
            parts.append(p["text"])
        return "\n".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", "messages")


def normalize_message(m: Any, i: int) -> dict:
    """One client message as the chat template wants it (vLLM does the same conversions)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", "messages")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {list(ROLES)}, got {json.dumps(role)}", "messages")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(m.get("content"), where),
    }
    if role == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            out["reasoning_content"] = _text(reasoning, where)
        calls = []
        for j, c in enumerate(m.get("tool_calls") or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"{where}.tool_calls[{j}] needs function.name", "messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                # The template renders arguments key by key: the wire's JSON string becomes a dict.
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise bad(
                        f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {e}", "messages"
                    ) from None
            if not isinstance(args, dict):
                raise bad(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", "messages")
            calls.append(
                {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
            )
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if m.get(k) is not None:
                out[k] = m[k]
    return out


def read_chat_request(
    body: Any,
    *,
    served: str,
    efforts: Sequence[str],
    vocab_size: int,
) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_model(body, served)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' is required: a non-empty list of chat messages", "messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or not isinstance(t.get("function", t).get("name"), str) for t in tools
    ):
        raise bad("'tools' must be a list of {type: function, function: {name, parameters}}", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("only tool_choice 'auto' and 'none' are supported", "tool_choice")
    if body.get("tool_choice") == "none":
        tools = []
    effort = body.get("reasoning_effort")
    if effort is not None:
        level = EFFORT_ALIASES.get(effort, effort) if isinstance(effort, str) else effort
        if level not in efforts:
            raise bad(
                f"'reasoning_effort' must be one of {sorted({*efforts, *EFFORT_ALIASES})}, got {json.dumps(effort)}",
                "reasoning_effort",
            )
        effort = level
    top = _int(body, "top_logprobs", 0, 0, 20)
    if top:
        raise bad(
            "'top_logprobs' > 0 is not supported: jaxpi serve returns the sampled token's logprob only",
            "top_logprobs",
        )
    opts = body.get("stream_options") or {}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatRequest(
        messages=tuple(normalize_message(m, i) for i, m in enumerate(msgs)),
        tools=tuple(tools),
        effort=effort,
        sampling=read_sampling(body, vocab_size=vocab_size),
        stream=_bool(body, "stream"),
        include_usage=bool(opts.get("include_usage")) if isinstance(opts, dict) else False,
        logprobs=_bool(body, "logprobs"),
        return_token_ids=_bool(body, "return_token_ids"),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
        template_kwargs=dict(kwargs),
    )


# ---- completions (token-id prompts) --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[tuple[int, ...], ...] | None  # token-id prompts
    text_prompts: tuple[str, ...] | None  # or text, tokenised by the server
    sampling: Sampling
    logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool


def read_completion_request(body: Any, *, served: str, vocab_size: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_model(body, served)
    if _bool(body, "stream"):
        raise bad("'stream' is not supported on /v1/completions by jaxpi serve", "stream")
    if _bool(body, "echo"):
        raise bad("'echo' is not supported by jaxpi serve", "echo")
    p = body.get("prompt")
    ids = texts = None
    if isinstance(p, str):
        texts = (p,)
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        texts = tuple(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        ids = tuple(tuple(_token_ids(x, f"prompt[{i}]", vocab_size)) for i, x in enumerate(p))
    elif isinstance(p, list) and p:
        ids = (tuple(_token_ids(p, "prompt", vocab_size)),)
    else:
        raise bad("'prompt' is required: token ids (a list of ints or of lists) or text", "prompt")
    if ids is not None and any(not x for x in ids):
        raise bad("'prompt' has an empty token list", "prompt")
    return CompletionRequest(
        prompts=ids,
        text_prompts=texts,
        sampling=read_sampling(body, vocab_size=vocab_size),
        logprobs=_int(body, "logprobs", None, 0, 20),
        return_token_ids=_bool(body, "return_token_ids"),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
    )


# ---- responses -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`[DONE]` passed as a string)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def stream_chunks(response: Mapping[str, Any], *, include_usage: bool) -> list[dict]:
    """A finished chat.completion as OpenAI `chat.completion.chunk`s (the gateway re-streams
    upstream's reply with it; `jaxpi serve` streams as it samples, `jaxpi.serve.streaming`): per
    choice a role chunk, the reasoning, the content, one chunk per tool call, then the finish
    chunk (which carries the choice's token_ids and logprobs when the response has them); a usage
    chunk when asked. Reasoning goes out as `reasoning`, whichever name upstream used."""
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    chunks: list[dict] = []

    def chunk(choice: dict, **top: Any) -> None:
        chunks.append({**head, "choices": [choice], **top})

    for c in response["choices"]:
        i, msg = c["index"], c["message"]
        first = (
            {}
            if chunks or "prompt_token_ids" not in response
            else {"prompt_token_ids": response["prompt_token_ids"]}
        )
        chunk(
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            },
            **first,
        )
        reasoning = msg.get("reasoning") or msg.get("reasoning_content")  # vLLM's new and old names
        if reasoning:
            chunk(
                {
                    "index": i,
                    "delta": {"reasoning": reasoning},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        if msg.get("content"):
            chunk({"index": i, "delta": {"content": msg["content"]}, "logprobs": None, "finish_reason": None})
        for j, call in enumerate(msg.get("tool_calls") or []):
            delta = {
                "tool_calls": [
                    {"index": j, "id": call["id"], "type": "function", "function": dict(call["function"])}
                ]
            }
            chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        last = {"index": i, "delta": {}, "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}
        if "token_ids" in c:
            last["token_ids"] = c["token_ids"]
        chunk(last)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks
