"""The typed schemas of the session reader (`jaxpi.data.sessions`), and how a wrong field is told.

Every field the reader takes from a Pi entry, an OpenAI record or a sidecar goes through one of
these pydantic models: strict (no coercion: `"false"` is not a boolean, `3` is not a string),
unknown keys ignored. `_typed` turns the first fault into a `_RecordError` whose reason is
`missing_field` or `bad_field` and whose detail names the field's path and what it held.
"""

# ruff: noqa: N815 (the schemas' field names are Pi's JSON keys: parentId, toolCallId, ...)
from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError


class _RecordError(Exception):
    def __init__(self, line: int, reason: str, detail: str):
        super().__init__(detail)
        self.line, self.reason, self.detail = line, reason, detail


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def _content_value(v: Any) -> Any:
    """A string or a list of block objects (the blocks are then checked one by one)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        for i, b in enumerate(v):
            if not isinstance(b, dict):
                raise PydanticCustomError(
                    "content_type",
                    "[{i}] must be a content block object, not {got}",
                    {"i": i, "got": f"{_json_type(b)} {_short(b)}"},
                )
        return v
    raise PydanticCustomError(
        "content_type",
        "must be a string or a list of content blocks, not {got}",
        {"got": f"{_json_type(v)} {_short(v)}"},
    )


Content = Annotated[Any, AfterValidator(_content_value)]
OptContent = Annotated[Any, AfterValidator(lambda v: None if v is None else _content_value(v))]


class PiHeader(_Strict):
    type: str
    version: Any = None


class PiEntry(_Strict):
    type: str
    id: str
    parentId: str | None


class PiThinkingLevel(PiEntry):
    thinkingLevel: str | None = None


class PiCompaction(PiEntry):
    summary: str
    firstKeptEntryId: str
    systemMessage: dict[str, Any] | None = None  # 1.x: the prompt and tools at the compaction


class PiBranchSummary(PiEntry):
    summary: str | None = None


class PiCustomMessage(PiEntry):
    content: Content


class PiContextEdit(PiEntry):
    """1.x: replaces (or, with null, omits) one earlier entry's content in later model context."""

    targetId: str
    replacement: dict[str, Any] | None


class PiReplacement(_Strict):
    content: Content


class PiCustom(PiEntry):
    customType: str | None = None
    data: Any = None


class PiMessageEntry(PiEntry):
    message: dict[str, Any]


class Role(_Strict):
    role: str


class PiUser(_Strict):
    content: Content


class PiAssistant(_Strict):
    content: list[dict[str, Any]]
    stopReason: str | None = None
    thinkingLevel: str | None = None  # 1.x: the Pi level requested for this response


class PiSystem(_Strict):
    """1.x: the prompt and tool loadout; later ones patch `sections` by name (None removes one)."""

    content: Content = ""
    sections: dict[str, str | None] | None = None
    toolsAdded: list[dict[str, Any]] | None = None
    toolsRemoved: list[dict[str, Any]] | None = None


class PiToolDecl(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any]


class PiToolName(_Strict):
    name: str


class PiToolResult(_Strict):
    toolCallId: str
    toolName: str = ""
    content: Content


class PiBashExecution(_Strict):
    command: str = ""
    output: str = ""
    exitCode: int | None = None
    cancelled: bool | None = None
    truncated: bool | None = None
    fullOutputPath: str | None = None
    excludeFromContext: bool | None = None


class PiSummaryMessage(_Strict):  # roles custom / branchSummary / compactionSummary
    content: OptContent = None
    summary: str | None = None


class Block(_Strict):
    type: str


class TextBlock(_Strict):
    text: str


class ThinkingBlock(_Strict):
    thinking: str = ""


class ToolCallBlock(_Strict):
    id: str
    name: str
    arguments: dict[str, Any]


class AttemptMeta(_Strict):
    """`jaxpi.attempt` data, a sidecar, or an OpenAI record's `meta` (other keys are ignored)."""

    task_id: str | None = None
    verified: bool | None = None
    effort: str | None = None


class OARecord(_Strict):
    messages: list[Any]
    tools: list[Any] | None = None
    meta: dict[str, Any] | None = None


class OAMessage(_Strict):
    role: str
    content: OptContent = None


class OAAssistant(OAMessage):
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None


class OAToolMessage(OAMessage):
    tool_call_id: str
    name: str | None = None


class OAPart(_Strict):
    type: str | None = None
    text: str = ""


class OAFunction(_Strict):
    name: str
    arguments: Any = None


class OAToolCall(_Strict):
    id: str = ""
    type: str | None = None
    function: dict[str, Any]


class ToolFunction(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Strict):
    type: str | None = None
    function: dict[str, Any]


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_EXPECTED = {
    "string_type": "a string",
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "dict_type": "an object",
    "list_type": "an array",
    "model_type": "an object",
}


def _json_type(v: Any) -> str:
    return "null" if v is None else _JSON_TYPES.get(type(v), type(v).__name__)


def _short(v: Any, n: int = 60) -> str:
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def _path(where: str, loc: tuple) -> str:
    out = where
    for k in loc:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


M = TypeVar("M", bound=BaseModel)


def _typed(model: type[M], value: Any, line: int, where: str = "") -> M:
    """`value` validated against `model`; the first fault names its field path and what it got."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errs = e.errors(include_url=False)
    err = errs[0]
    field = _path(where, tuple(err["loc"])) or "record"
    if err["type"] == "missing":
        reason, detail = "missing_field", f"missing {field!r}"
    elif err["type"] == "content_type":
        reason, detail = "bad_field", f"{field}{'' if err['msg'].startswith('[') else ' '}{err['msg']}"
    else:
        got = err["input"]
        want = _EXPECTED.get(err["type"])
        what = f"must be {want}" if want else err["msg"].lower()
        reason, detail = "bad_field", f"{field} {what}, not {_json_type(got)} {_short(got)}"
    if len(errs) > 1:
        detail += f" (and {len(errs) - 1} more)"
    raise _RecordError(line, reason, detail)


def _need_dict(value: Any, line: int, where: str) -> dict:
    if not isinstance(value, dict):
        raise _RecordError(
            line, "bad_field", f"{where} must be an object, not {_json_type(value)} {_short(value)}"
        )
    return value
