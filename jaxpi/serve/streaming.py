"""One sampled turn, a few tokens at a time, as OpenAI stream deltas: reasoning, content, tool calls.

    new ids ──► Detokenizer ──► text so far ──► view(text): (reasoning, content, complete calls)
                                                  └─► deltas: what the view shows beyond what was sent
    turn end ──► ChatFormat.turn (the non-stream reply) ──► its text beyond what was sent

The view shows only text that the finished turn keeps where it is, so the deltas of a stream add
up to the non-stream message:

- reasoning: the thinking block's text, without the newlines at its edges (the turn strips them)
  and without a tail that may be the start of `</think>` or of the end-of-turn token;
- content: the text after the block, stripped as the turn strips it, up to the first
  `<tool_call>` and without a tail that may begin one;
- a tool call once its `</tool_call>` has arrived, it parses against the request's tools, and
  what follows it is another `<tool_call>` or the end-of-turn token (when that ends the turn:
  not under `ignore_eos`). vLLM sends a call once it is parsed, too.

A call sent this way cannot be taken back: a turn that goes wrong after it (a later call that does
not parse, the budget running out inside one) ends as its non-stream reply does (`finish_reason`
`stop` or `length`, its raw text as content), with the calls already sent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from jaxpi.data.tools import tool_schemas
from jaxpi.envs.toolcalls import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, parse_call
from jaxpi.serve.chat import ChatFormat, Turn, permissive
from jaxpi.serve.protocol import ChatRequest


class Detokenizer:
    """Token ids to text a piece at a time; a character split across tokens waits for its rest
    (the offsets scheme of vLLM's incremental detokenizer)."""

    def __init__(self, tok: Any):
        self.tok, self.ids, self.text = tok, [], ""
        self._prefix = self._read = 0  # ids[prefix:read] decode to the text's last piece

    def add(self, ids: Sequence[int]) -> str:
        self.ids += ids
        before = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=False)
        after = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


def _hold(s: str, markers: Sequence[str], space: str | None) -> str:
    """`s` without trailing `space` characters (None: any whitespace) and without a tail that may
    begin one of `markers`."""
    while True:
        s = s.rstrip(space)
        cut = next(
            (k for m in markers for k in range(min(len(m) - 1, len(s)), 0, -1) if s.endswith(m[:k])), 0
        )
        if not cut:
            return s
        s = s[:-cut]


def view(text: str, *, thinking_open: bool, eot: str) -> tuple[str | None, str, str | None]:
    """(reasoning, content, the text from the first `<tool_call>` on) that the finished turn keeps;
    reasoning None: the turn has no thinking block (or it is not known yet and nothing shows)."""
    body = text[: -len(eot)] if text.endswith(eot) else text
    thinking, start = thinking_open, 0
    if not thinking_open:
        s = body.lstrip()
        if len(s) < len(THINK_OPEN) and THINK_OPEN.startswith(s):
            return None, "", None  # may still become a thinking block
        if s.startswith(THINK_OPEN):
            thinking, start = True, len(body) - len(s) + len(THINK_OPEN)
    reasoning = None
    rest = body
    if thinking:
        end = body.find(THINK_CLOSE, start)
        if end < 0:
            return _hold(body[start:].lstrip("\n"), (THINK_CLOSE, eot), "\n"), "", None
        reasoning, rest = body[start:end].strip("\n"), body[end + len(THINK_CLOSE) :]
    first = rest.find(CALL_OPEN)
    if first >= 0:
        return reasoning, rest[:first].strip(), rest[first:]
    return reasoning, _hold(rest.lstrip(), (CALL_OPEN, eot), None), None


class TurnStream:
    """The deltas of one choice's turn: `feed` the ids as they are sampled, `finish` at the end."""

    def __init__(self, fmt: ChatFormat, req: ChatRequest, thinking_open: bool):
        self.fmt, self.req, self.thinking_open = fmt, req, thinking_open
        self._eot_ends = not req.sampling.ignore_eos  # under ignore_eos the turn goes on after it
        self.detok = Detokenizer(fmt.tok)
        self.reasoning = self.content = ""  # sent so far
        self.calls: list[dict] = []  # sent so far
        self._tools = list(req.tools)

    def _parse(self, body: str) -> Any:
        try:
            call, _ = parse_call(body, tool_schemas(self._tools))
        except ValueError:  # a schema keyword the validator does not know: names only, as `turn`
            call, _ = parse_call(body, tool_schemas(permissive(self._tools)))
        return call

    def _complete_calls(self, calls_text: str, ended: bool) -> list[Any]:
        """The calls at the start of `calls_text` that are parsed and followed by another call or
        by the end of the turn."""
        out = []
        while True:
            calls_text = calls_text.lstrip()
            if not calls_text.startswith(CALL_OPEN):
                return out
            close = calls_text.find(CALL_CLOSE)
            if close < 0:
                return out
            body = calls_text[len(CALL_OPEN) : close]
            call = None if CALL_OPEN in body else self._parse(body)
            if call is None:
                return out
            calls_text = calls_text[close + len(CALL_CLOSE) :]
            after = calls_text.lstrip()
            if not (after.startswith(CALL_OPEN) or (ended and not after)):
                return out
            out.append(call)

    def _deltas(self, reasoning: str | None, content: str, calls: Sequence[dict]) -> list[dict]:
        out: list[dict] = []
        if reasoning and reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append({"reasoning": reasoning[len(self.reasoning) :]})
            self.reasoning = reasoning
        if content and content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content) :]})
            self.content = content
        for call in calls[len(self.calls) :]:
            j = len(self.calls)
            out.append({"tool_calls": [{"index": j, **call}]})
            self.calls.append(call)
        return out

    def feed(self, ids: Sequence[int]) -> list[dict]:
        """Deltas for newly sampled ids (often none while a marker may be forming)."""
        self.detok.add(ids)
        text = self.detok.text
        eot = self.fmt.eot
        reasoning, content, calls_text = view(text, thinking_open=self.thinking_open, eot=eot)
        calls = list(self.calls)
        if calls_text is not None and self._tools:
            ended = self._eot_ends and text.endswith(eot)
            for c in self._complete_calls(calls_text, ended=ended)[len(self.calls) :]:
                calls.append(
                    {
                        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": json.dumps(dict(c.arguments), ensure_ascii=False),
                        },
                    }
                )
        return self._deltas(reasoning, content, calls)

    def finish(self, ids: Sequence[int], finish_reason: str) -> tuple[list[dict], Turn]:
        """The last deltas and the turn as the non-stream reply has it (`ids`: the whole turn)."""
        turn = self.fmt.turn(self.req, ids, finish_reason, self.thinking_open)
        msg = turn.message
        return self._deltas(msg["reasoning"], msg["content"] or "", msg.get("tool_calls") or []), turn
