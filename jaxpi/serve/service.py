"""The endpoints of `jaxpi serve` as functions from request JSON to response JSON (no sockets here)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpi.rollout.engine import SamplingParams
from jaxpi.serve.batcher import Batcher, Row
from jaxpi.serve.chat import ChatFormat
from jaxpi.serve.protocol import (
    ApiError,
    Sampling,
    bad,
    new_id,
    now,
    read_chat_request,
    read_completion_request,
)


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """A chat.completion and how the client wants it delivered."""

    response: dict[str, Any]
    stream: bool
    include_usage: bool


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
    def _rows(self, prompt: list[int], s: Sampling, extra_stops: tuple[int, ...]) -> list[Row]:
        if len(prompt) >= self.max_len:
            raise bad(
                f"the prompt has {len(prompt)} tokens; this server's context limit is {self.max_len} "
                "tokens (prompt + completion, --max-len)",
                "messages",
            )
        stops = tuple(dict.fromkeys((*s.stop_token_ids, *(() if s.ignore_eos else extra_stops))))
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=min(s.max_tokens, self.max_len - len(prompt)),
            stop_token_ids=stops,
        )
        # Choice j of a seeded request has its own key (the engine folds row keys as int32).
        keys = [None if s.seed is None else (s.seed + 1_000_003 * j) % 2**31 for j in range(s.n)]
        return [Row(list(prompt), params, k) for k in keys]

    def _run(self, rows: list[Row]) -> list[Any]:
        try:
            return self.batcher.submit(rows, timeout=self.timeout_s)
        except TimeoutError as e:
            raise ApiError(504, str(e), kind="timeout_error") from None
        except ValueError as e:  # the engine refused the input (e.g. a token id)
            raise bad(str(e)) from None
        except RuntimeError as e:  # shutting down
            raise ApiError(503, str(e), kind="service_unavailable") from None

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

    def chat(self, body: Any) -> ChatReply:
        req = read_chat_request(
            body,
            served=self.served,
            efforts=self.fmt.efforts,
            default_max_tokens=self.max_new_tokens,
            max_tokens_cap=None,  # clamped to the context left (vLLM would refuse)
            vocab_size=self.vocab_size,
        )
        prompt = self.fmt.prompt(req)
        comps = self._run(self._rows(prompt.ids, req.sampling, (self.fmt.eot_id,)))
        choices, completion_tokens, reasoning_tokens = [], 0, 0
        for i, c in enumerate(comps):
            turn = self.fmt.turn(req, c.token_ids, c.finish_reason, prompt.thinking_open)
            choice: dict[str, Any] = {
                "index": i,
                "message": turn.message,
                "logprobs": {"content": self._logprob_items(c.token_ids, c.logprobs, req.tokens_as_ids)}
                if req.logprobs
                else None,
                "finish_reason": turn.finish_reason,
                "stop_reason": c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
            completion_tokens += len(c.token_ids)
            reasoning_tokens += turn.reasoning_tokens
        out: dict[str, Any] = {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.served,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt.ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt.ids) + completion_tokens,
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            },
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = list(prompt.ids)
        return ChatReply(out, req.stream, req.include_usage)

    def completions(self, body: Any) -> dict[str, Any]:
        req = read_completion_request(
            body,
            served=self.served,
            max_tokens_cap=None,  # clamped to the context left (vLLM would refuse)
            vocab_size=self.vocab_size,
        )
        prompts = (
            [list(p) for p in req.prompts] if req.prompts else [self.fmt.encode(t) for t in req.text_prompts]
        )
        if any(not p for p in prompts):
            raise bad("'prompt' is empty", "prompt")
        eos = self.fmt.tok.eos_token_id
        rows = [r for p in prompts for r in self._rows(p, req.sampling, () if eos is None else (eos,))]
        comps = self._run(rows)
        choices, n_prompt = [], 0
        for i, (row, c) in enumerate(zip(rows, comps, strict=True)):
            choice: dict[str, Any] = {
                "index": i,
                "text": self.fmt.tok.decode(c.token_ids, skip_special_tokens=False),
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None,
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
