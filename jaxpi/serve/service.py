"""The endpoints of `jaxpi serve` as functions from request JSON to response JSON (no sockets here)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

from jaxpi.rollout.engine import SamplingParams
from jaxpi.serve.batcher import Batcher, Row
from jaxpi.serve.chat import ChatFormat, Prompt, Turn
from jaxpi.serve.protocol import (
    ApiError,
    ChatRequest,
    Sampling,
    bad,
    new_id,
    now,
    read_chat_request,
    read_completion_request,
    status_error,
)
from jaxpi.serve.streaming import TurnStream

log = logging.getLogger("jaxpi.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions


@dataclasses.dataclass
class RequestInfo:
    """What one request's log line and metrics report; the endpoints fill it in as they learn it."""

    model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stream: bool = False


@dataclasses.dataclass(frozen=True)
class PreparedChat:
    """A validated chat request, its prompt and its engine rows (not yet queued)."""

    req: ChatRequest
    prompt: Prompt
    rows: list[Row]


class Service:
    """Chat and token-id completions over one batcher; `max_len` is the context limit per row."""

    def __init__(
        self,
        fmt: ChatFormat,
        batcher: Batcher,
        *,
        served: str,
        max_len: int,
        max_new_tokens: int,
        vocab_size: int,
        timeout_s: float = 600.0,
    ):
        self.fmt, self.batcher, self.served = fmt, batcher, served
        self.max_len, self.max_new_tokens, self.vocab_size = max_len, max_new_tokens, vocab_size
        self.timeout_s = timeout_s
        self.created = now()

    # ---- shared -----------------------------------------------------------------------------------
    def _rows(
        self,
        prompt: list[int],
        s: Sampling,
        extra_stops: tuple[int, ...],
        default_max_tokens: int,
        param: str = "messages",
    ) -> list[Row]:
        if len(prompt) >= self.max_len:
            raise bad(
                f"the prompt has {len(prompt)} tokens; this server's context limit is {self.max_len} "
                "tokens (prompt + completion, --max-len)",
                param,
            )
        left = self.max_len - len(prompt)
        if s.max_tokens is not None and s.max_tokens > left:
            # vLLM refuses too (a silent clamp would hide a client's wrong budget).
            raise bad(
                f"'max_tokens' is too large: {s.max_tokens}. This server's context limit is "
                f"{self.max_len} tokens (--max-len) and the prompt has {len(prompt)} tokens, so at most "
                f"{left} can be generated ({s.max_tokens} > {self.max_len} - {len(prompt)})",
                "max_tokens",
            )
        stops = tuple(dict.fromkeys((*s.stop_token_ids, *(() if s.ignore_eos else extra_stops))))
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=min(default_max_tokens, left) if s.max_tokens is None else s.max_tokens,
            stop_token_ids=stops,
        )
        # Choice j of a seeded request has its own key (the engine folds row keys as int32).
        keys = [None if s.seed is None else (s.seed + 1_000_003 * j) % 2**31 for j in range(s.n)]
        return [Row(list(prompt), params, k, index=j) for j, k in enumerate(keys)]

    def _run(self, rows: list[Row]) -> list[Any]:
        try:
            return self.batcher.submit(rows, timeout=self.timeout_s)
        except (TimeoutError, ValueError, RuntimeError) as e:
            raise self._engine_error(e) from None

    @staticmethod
    def _engine_error(e: BaseException) -> Exception:
        if isinstance(e, TimeoutError):
            return ApiError(504, str(e))
        if isinstance(e, ValueError):  # the engine refused the input (e.g. a token id)
            return bad(str(e))
        if isinstance(e, RuntimeError):  # shutting down
            return ApiError(503, str(e))
        return e

    def _logprob_items(self, ids: list[int], lps: list[float], as_ids: bool) -> list[dict]:
        out = []
        for t, lp in zip(ids, lps, strict=True):
            text = self.fmt.token_text(t, as_ids)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    # ---- endpoints --------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "jaxpi",
                    "max_model_len": self.max_len,
                }
            ],
        }

    def prepare_chat(self, body: Any, info: RequestInfo | None = None) -> PreparedChat:
        """Validate and render a chat request (every refusal is raised here, before any answer)."""
        req = read_chat_request(
            body, served=self.served, efforts=self.fmt.efforts, vocab_size=self.vocab_size
        )
        info = info or RequestInfo()
        info.model, info.stream = self.served, req.stream
        prompt = self.fmt.prompt(req)
        rows = self._rows(prompt.ids, req.sampling, (self.fmt.eot_id,), self.max_new_tokens)
        info.prompt_tokens = len(prompt.ids)
        return PreparedChat(req, prompt, rows)

    def _choice(self, req: ChatRequest, i: int, c: Any, turn: Turn) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": i,
            "message": turn.message,
            "logprobs": {"content": self._logprob_items(c.token_ids, c.logprobs, req.tokens_as_ids)}
            if req.logprobs
            else None,
            "finish_reason": turn.finish_reason,
            "stop_reason": _stop_reason(c),
        }
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    @staticmethod
    def _usage(n_prompt: int, n_out: int, reasoning_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        }

    def chat(self, body: Any, info: RequestInfo | None = None) -> dict[str, Any]:
        """A non-stream chat.completion."""
        return self.run_chat(self.prepare_chat(body, info), info)

    def run_chat(self, prep: PreparedChat, info: RequestInfo | None = None) -> dict[str, Any]:
        req, prompt = prep.req, prep.prompt
        comps = self._run(prep.rows)
        choices, completion_tokens, reasoning_tokens = [], 0, 0
        for i, c in enumerate(comps):
            turn = self.fmt.turn(req, c.token_ids, c.finish_reason, prompt.thinking_open)
            choices.append(self._choice(req, i, c, turn))
            completion_tokens += len(c.token_ids)
            reasoning_tokens += turn.reasoning_tokens
        if info is not None:
            info.completion_tokens = completion_tokens
        out: dict[str, Any] = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.served,
            "choices": choices,
            "usage": self._usage(len(prompt.ids), completion_tokens, reasoning_tokens),
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = list(prompt.ids)
        return out

    def stream_chat(self, prep: PreparedChat, info: RequestInfo | None = None) -> Iterator[dict[str, Any]]:
        """The chat.completion.chunks of a stream, each as soon as the engine has sampled it: per
        choice a role chunk at once, then reasoning / content deltas and tool calls as they form
        (`jaxpi.serve.streaming`), a finish chunk, and a usage chunk when the client asked. Token
        ids and log-probs (when asked) ride on the chunk that first shows their text. A failure
        after the first chunk is one `{"error": ...}` event (the status is already 200)."""
        req, prompt, rows = prep.req, prep.prompt, prep.rows
        head = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": now(),
            "model": self.served,
        }
        events: queue.Queue = queue.Queue()
        for r in rows:
            r.stream = events
        streams = [TurnStream(self.fmt, req, prompt.thinking_open) for _ in rows]
        pending: list[tuple[list[int], list[float]]] = [([], []) for _ in rows]
        usage = [0, 0]  # completion tokens, reasoning tokens

        def chunk(i: int, delta: dict, finish: str | None = None, **extra: Any) -> dict[str, Any]:
            ids, lps = pending[i]
            choice: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": {"content": self._logprob_items(ids, lps, req.tokens_as_ids)}
                if req.logprobs and ids
                else None,
                "finish_reason": finish,
                **extra,
            }
            if req.return_token_ids and ids:
                choice["token_ids"] = list(ids)
            pending[i] = ([], [])
            return {**head, "choices": [choice]}

        try:
            for i in range(len(rows)):
                first = {"prompt_token_ids": list(prompt.ids)} if req.return_token_ids and i == 0 else {}
                yield {**chunk(i, {"role": "assistant", "content": ""}), **first}
            try:
                self.batcher.put(rows)
            except RuntimeError as e:
                raise ApiError(503, str(e)) from None
            deadline, open_rows = time.monotonic() + self.timeout_s, len(rows)
            while open_rows:
                try:
                    i, ids, lps = events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise ApiError(504, f"no completion within {self.timeout_s} s") from None
                r = rows[i]
                if ids is not None:
                    pending[i][0].extend(ids)
                    pending[i][1].extend(lps)
                    for delta in streams[i].feed(ids):
                        yield chunk(i, delta)
                    continue
                open_rows -= 1
                if r.error is not None:
                    raise self._engine_error(r.error)
                c = r.result
                deltas, turn = streams[i].finish(c.token_ids, c.finish_reason)
                for delta in deltas:
                    yield chunk(i, delta)
                usage[0] += len(c.token_ids)
                usage[1] += turn.reasoning_tokens
                if info is not None:
                    info.completion_tokens = usage[0]
                yield chunk(i, {}, turn.finish_reason, stop_reason=_stop_reason(c))
            if req.include_usage:
                yield {**head, "choices": [], "usage": self._usage(len(prompt.ids), *usage)}
        except ApiError as e:
            yield e.body()
        except Exception as e:  # the status is sent: the failure can only be an event now
            log.exception("internal error in a stream")
            yield status_error(500, f"internal error: {type(e).__name__}: {e}")
        finally:
            for r in rows:  # the client went away (or the stream ended): stop what still runs
                r.cancelled.set()

    def completions(self, body: Any, info: RequestInfo | None = None) -> dict[str, Any]:
        req = read_completion_request(body, served=self.served, vocab_size=self.vocab_size)
        info = info or RequestInfo()
        info.model = self.served
        prompts = (
            [list(p) for p in req.prompts] if req.prompts else [self.fmt.encode(t) for t in req.text_prompts]
        )
        if any(not p for p in prompts):
            raise bad("'prompt' is empty", "prompt")
        eos = self.fmt.tok.eos_token_id
        stops = () if eos is None else (eos,)
        rows = [
            r
            for p in prompts
            for r in self._rows(p, req.sampling, stops, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
        ]
        info.prompt_tokens = sum(len(p) for p in prompts)
        comps = self._run(rows)
        info.completion_tokens = sum(len(c.token_ids) for c in comps)
        choices, n_prompt = [], 0
        for i, (row, c) in enumerate(zip(rows, comps, strict=True)):
            choice: dict[str, Any] = {
                "index": i,
                "text": self.fmt.tok.decode(c.token_ids, skip_special_tokens=False),
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": _stop_reason(c),
            }
            if req.logprobs is not None:
                tokens = [self.fmt.token_text(t, req.tokens_as_ids) for t in c.token_ids]
                offsets, pos = [], 0
                for t in c.token_ids:
                    offsets.append(pos)
                    pos += len(self.fmt.tok.decode([t], skip_special_tokens=False))
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": list(c.logprobs),
                    # The engine keeps no top-k: each position lists the sampled token alone.
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, c.logprobs, strict=True)],
                    "text_offset": offsets,
                }
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(row.prompt)
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(len(c.token_ids) for c in comps)
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": self.served,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }


def _stop_reason(c: Any) -> int | None:
    """vLLM's stop_reason: the stop token that ended the turn, or None."""
    return c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None
