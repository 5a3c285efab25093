"""Chat requests to token ids and sampled turns back to OpenAI messages, with the checkpoint's template.

    prompt  = template(system + effort line, messages, tools, generation prompt)  -> token ids
    turn    = decode(sampled ids) -> parse_turn -> reasoning / content / tool_calls

The effort level works as in training (`jaxpi.data.render`): its line joins the system message and
its template kwargs (e.g. `enable_thinking`) go to the template. The prompt is tokenised as one
text, exactly as vLLM does, so a client that sends a turn back unchanged gets a prompt that extends
the previous prompt + completion token for token wherever the template is prefix-consistent.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

from jaxpi.data.render import RenderConfig
from jaxpi.envs.toolcalls import ParsedTurn, count_reasoning_tokens, parse_turn, split_thinking
from jaxpi.serve.protocol import ChatRequest, bad


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    thinking_open: bool  # the generation prompt opened <think>: the turn starts inside the block
    effort: str


@dataclasses.dataclass(frozen=True)
class Turn:
    """One sampled turn as the API returns it."""

    message: dict[str, Any]
    finish_reason: str  # stop | length | tool_calls
    reasoning_tokens: int
    parse_error: str | None  # why tool calls were not recognised (the text is then plain content)


def permissive(tools: Sequence[dict]) -> list[dict]:
    """The same tools with schemas that accept any object (for schemas our validator cannot read)."""
    out = []
    for t in tools:
        fn = t.get("function", t)
        out.append({"name": fn["name"], "parameters": {"type": "object", "additionalProperties": True}})
    return out


class ChatFormat:
    """The tokenizer's chat template plus the effort styles of a `RenderConfig`."""

    def __init__(self, tokenizer: Any, render_cfg: RenderConfig):
        self.tok, self.cfg = tokenizer, render_cfg
        vocab = tokenizer.get_vocab()
        self.eot = render_cfg.end_of_turn or tokenizer.eos_token
        if self.eot not in vocab:
            raise ValueError(f"end-of-turn token {self.eot!r} is not a single token of the tokenizer")
        self.eot_id = vocab[self.eot]
        self.think_open, self.think_close = vocab.get("<think>", -1), vocab.get("</think>", -1)

    @property
    def efforts(self) -> list[str]:
        return list(self.cfg.efforts)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def messages(self, req: ChatRequest) -> tuple[list[dict], dict, str]:
        """(messages with the effort line in the system message, template kwargs, effort)."""
        effort = req.effort or self.cfg.default_effort
        style = self.cfg.efforts[effort]
        msgs = [dict(m) for m in req.messages]
        if style.system:
            if msgs[0]["role"] == "system":
                msgs[0]["content"] = (
                    f"{msgs[0]['content']}\n\n{style.system}" if msgs[0]["content"] else style.system
                )
            else:
                msgs.insert(0, {"role": "system", "content": style.system})
        return msgs, {**style.template_kwargs, **req.template_kwargs}, effort

    def prompt(self, req: ChatRequest) -> Prompt:
        msgs, kwargs, effort = self.messages(req)
        try:
            text = self.tok.apply_chat_template(
                msgs, tools=list(req.tools) or None, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja's TemplateError, raise_exception() in the template, bad kwargs
            raise bad(f"the chat template rejected the conversation: {e}", "messages") from None
        return Prompt(text, self.encode(text), text.rstrip("\n").endswith("<think>"), effort)

    def turn(self, req: ChatRequest, ids: Sequence[int], finish: str, thinking_open: bool) -> Turn:
        text = self.tok.decode(list(ids), skip_special_tokens=False)
        reasoning_tokens = count_reasoning_tokens(
            ids, self.think_open, self.think_close, thinking_open=thinking_open
        )
        parsed: ParsedTurn | None = None
        error = None
        if finish == "stop":
            try:
                parsed = parse_turn(text, list(req.tools), thinking_open=thinking_open, end_of_turn=self.eot)
            except ValueError:  # a schema keyword our validator does not know: check names only
                parsed = parse_turn(
                    text, permissive(req.tools), thinking_open=thinking_open, end_of_turn=self.eot
                )
            error = parsed.error
        if parsed is not None and parsed.error is None:
            reasoning, content, has_thinking = parsed.reasoning, parsed.content, parsed.has_thinking
            calls = parsed.tool_calls
        else:
            # Unparseable or cut short: the raw text after the thinking block is the content
            # (stripped, as a parsed turn's, so that a stream's deltas add up to it).
            body = text[: -len(self.eot)] if text.endswith(self.eot) else text
            sp = split_thinking(body, thinking_open=thinking_open)
            reasoning, content, has_thinking, calls = sp.reasoning, sp.rest.strip(), sp.has_thinking, ()
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        # vLLM's current field name (it was `reasoning_content`, which current vLLM no longer sends)
        msg["reasoning"] = reasoning if has_thinking or thinking_open else None
        if calls:
            msg["tool_calls"] = [
                {
                    "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(dict(c.arguments), ensure_ascii=False),
                    },
                }
                for c in calls
            ]
        return Turn(msg, "tool_calls" if calls else finish, reasoning_tokens, error)

    def token_text(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tok.decode([token_id], skip_special_tokens=False)
