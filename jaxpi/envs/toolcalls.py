"""Parse one generated assistant turn: its thinking block, its answer text and its tool calls.

The format is the one the chat template teaches (Qwen3.5 / qwen3-coder XML):

    <think>\\n REASONING \\n</think>\\n\\n CONTENT
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    <|im_end|>

When the generation prompt already opened the thinking block (`<|im_start|>assistant\\n<think>\\n`),
the sampled text starts inside it, so `thinking_open=True` treats everything before `</think>` as
reasoning. Parameter values are strings on the wire; like the qwen3-coder parser, a value whose
schema type is not `string` is read as JSON. Any deviation (unclosed block, text after a call,
unknown tool, missing or mis-typed argument) makes the turn malformed with a reason, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxpi.data.tools import tool_schemas, validate

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>\n(.*?)</function>\s*\Z", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n?", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn split into its parts; `error` is None exactly when it is well formed."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    has_thinking: bool = False  # a (closed) thinking block was found

    @property
    def is_final(self) -> bool:
        """A well-formed turn without tool calls: the attempt's final answer."""
        return self.error is None and not self.tool_calls

    def message(self) -> dict:
        """The turn as a chat message the template can re-render."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.has_thinking:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                for c in self.tool_calls
            ]
        return msg


@dataclass(frozen=True)
class _Split:
    reasoning: str
    rest: str
    has_thinking: bool
    error: str | None = field(default=None)


def split_thinking(text: str, *, thinking_open: bool) -> _Split:
    """(reasoning, text after the block); an opened block that never closes is an error."""
    start = 0
    if not thinking_open:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            if THINK_CLOSE in text or THINK_OPEN in text:
                return _Split("", text, False, "thinking block not at the start of the turn")
            return _Split("", text, False)
        start = len(text) - len(stripped) + len(THINK_OPEN)
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        return _Split(text[start:].strip("\n"), "", True, "thinking block is not closed")
    rest = text[end + len(THINK_CLOSE) :]
    if THINK_OPEN in rest or THINK_CLOSE in rest:
        return _Split(text[start:end].strip("\n"), rest, True, "more than one thinking block")
    return _Split(text[start:end].strip("\n"), rest.lstrip("\n"), True)


def _coerce(value: str, schema: Mapping[str, Any] | None) -> Any:
    if schema is not None and schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # left as a string: the schema check reports the type mismatch


def parse_call(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[ToolCall | None, str | None]:
    """One `<tool_call>` body (between the tags) -> (call, None) or (None, reason)."""
    m = _FUNCTION.match(body)
    if m is None:
        return None, "tool call is not <function=NAME>...</function>"
    name, params = m.group(1).strip(), m.group(2)
    if name not in schemas:
        return None, f"unknown tool {name!r}"
    props = schemas[name].get("properties", {})
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAM.finditer(params):
        if params[pos : p.start()].strip():
            return None, f"{name}: unparseable text between parameters"
        key = p.group(1).strip()
        if key in args:
            return None, f"{name}: parameter {key!r} given twice"
        args[key] = _coerce(p.group(2), props.get(key))
        pos = p.end()
    if params[pos:].strip():
        return None, f"{name}: unparseable parameter block"
    errors = validate(schemas[name], args, where=name)
    if errors:
        return None, "bad arguments: " + "; ".join(errors)
    return ToolCall(name, args), None


def parse_turn(
    text: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    thinking_open: bool = False,
    end_of_turn: str = "<|im_end|>",
) -> ParsedTurn:
    """Split a decoded assistant turn (special tokens kept) into reasoning, content and tool calls."""
    if text.endswith(end_of_turn):
        text = text[: -len(end_of_turn)]
    split = split_thinking(text, thinking_open=thinking_open)
    if split.error:
        return ParsedTurn(split.reasoning, split.rest, (), split.error, split.has_thinking)
    rest = split.rest
    first = rest.find(CALL_OPEN)
    if first < 0:
        err = f"unmatched {CALL_CLOSE}" if CALL_CLOSE in rest else None
        return ParsedTurn(split.reasoning, rest.strip(), (), err, split.has_thinking)
    content, calls_text = rest[:first].strip(), rest[first:]
    calls: list[ToolCall] = []
    schemas = tool_schemas(list(tools))
    while calls_text.strip():
        calls_text = calls_text.lstrip()
        if not calls_text.startswith(CALL_OPEN):
            return ParsedTurn(split.reasoning, content, (), "text after a tool call", split.has_thinking)
        close = calls_text.find(CALL_CLOSE)
        if close < 0:
            return ParsedTurn(split.reasoning, content, (), "tool call is not closed", split.has_thinking)
        body = calls_text[len(CALL_OPEN) : close]
        if CALL_OPEN in body:
            return ParsedTurn(split.reasoning, content, (), "nested tool call", split.has_thinking)
        call, err = parse_call(body, schemas)
        if err:
            return ParsedTurn(split.reasoning, content, (), err, split.has_thinking)
        calls.append(call)
        calls_text = calls_text[close + len(CALL_CLOSE) :]
    return ParsedTurn(split.reasoning, content, tuple(calls), None, split.has_thinking)


def count_reasoning_tokens(
    ids: Sequence[int], think_open_id: int, think_close_id: int, *, thinking_open: bool
) -> int:
    """Tokens of one sampled turn inside its thinking block (the tags themselves excluded).

    An opened block that never closes (the turn ran out of budget) counts to the turn's end:
    those tokens were all spent reasoning.
    """
    ids = list(ids)
    start = 0
    if not thinking_open:
        if think_open_id not in ids:
            return 0
        start = ids.index(think_open_id) + 1
    if think_close_id in ids[start:]:
        return ids.index(think_close_id, start) - start
    return len(ids) - start
