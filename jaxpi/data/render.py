"""Render sessions with the checkpoint's own chat template, with a loss mask on the assistant's tokens.

The mask must mark exactly what the model produced when the session was generated: reasoning,
text, tool calls and the end-of-turn token; never the system/user/tool text, the generation
prompt (`<|im_start|>assistant\\n`, and any `<think>\\n` the template appends to it) or the
newline after `<|im_end|>`. We get it without knowing the template's markup:

    prompt_k = render(messages[:k], add_generation_prompt=True)   # what the engine was given
    full_k   = render(messages[:k+1])
    own_k    = full_k[len(prompt_k):] cut right after the end-of-turn token

and the token ids are built incrementally, as an inference engine sees them: the new prompt text
since the previous turn (mask 0), then `own_k` (mask 1), each tokenised on its own and concatenated.

Templates like Qwen's drop the reasoning of assistant turns once a later user message arrives, so
`prompt_k` may stop extending the text built so far. Then a new example starts at turn k, whose
prompt holds the earlier turns in their stripped form (mask 0). Every example is thus exactly a
sequence the model saw, and each supervised turn keeps its reasoning.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from jaxpi.data.sessions import DataError, Session
from jaxpi.data.tools import pi_tools

DEFAULT_SYSTEM = (
    "You are an expert coding assistant operating inside pi, a coding agent harness. You help users "
    "by reading files, executing commands, editing code, and writing new files."
)


@dataclass(frozen=True)
class EffortStyle:
    """How one effort level reaches the model: chat-template kwargs and a system-prompt line."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    system: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_kwargs", MappingProxyType(dict(self.template_kwargs)))


def _pi_efforts() -> Mapping[str, EffortStyle]:
    styles = {"off": EffortStyle({"enable_thinking": False})}
    for level in ("minimal", "low", "medium", "high", "xhigh"):
        styles[level] = EffortStyle({"enable_thinking": True}, f"Reasoning effort: {level}.")
    return MappingProxyType(styles)


@dataclass(frozen=True)
class RenderConfig:
    """How sessions become token ids.

    tokenizer_dir: a transformers tokenizer directory (usually the checkpoint's) with a chat template.
    efforts: level -> EffortStyle (or a dict {"template_kwargs": ..., "system": ...}).
    default_effort: used for sessions whose effort is unknown.
    tools: schemas listed to the model when a session has none of its own (None: Pi's four tools).
    keep_session_system: a session's own system message replaces `system_prompt` when present.
    end_of_turn: the token text that closes an assistant turn (None: the tokenizer's eos token).
    """

    tokenizer_dir: str | Path
    system_prompt: str = DEFAULT_SYSTEM
    efforts: Mapping[str, EffortStyle | Mapping[str, Any]] = field(default_factory=_pi_efforts)
    default_effort: str = "medium"
    tools: tuple[dict, ...] | None = None
    keep_session_system: bool = True
    end_of_turn: str | None = None

    def __post_init__(self) -> None:
        styles = {
            k: v if isinstance(v, EffortStyle) else EffortStyle(**dict(v)) for k, v in self.efforts.items()
        }
        object.__setattr__(self, "efforts", MappingProxyType(styles))
        object.__setattr__(self, "tokenizer_dir", str(self.tokenizer_dir))
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(self.tools))
        if self.default_effort not in styles:
            raise ValueError(f"default_effort {self.default_effort!r} is not in efforts {sorted(styles)}")


@dataclass(frozen=True, eq=False)
class Example(Mapping):
    """One training sequence; as a mapping it is {"input_ids", "loss_mask"} (what the pipeline reads).

    `input_ids`/`loss_mask` are int32 [n]; mask 1 = a token the assistant produced.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    source: str
    effort: str
    assistant_tokens: int
    reasoning_tokens: int
    turns: int  # supervised assistant turns
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) token range of each supervised turn

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in ("input_ids", "loss_mask"):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("input_ids", "loss_mask"))

    def __len__(self) -> int:
        return 2

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class RenderError(DataError):
    """The template does not render a session as a prefix-consistent conversation; `location` is
    the `file:line` of the assistant turn at fault (empty when unknown)."""

    def __init__(self, message: str, location: str = ""):
        super().__init__(message)
        self.location = location


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(dir)`, cached; the directory must carry a chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer in {tokenizer_dir} has no chat_template")
    return tok


def conversation(session: Session, cfg: RenderConfig) -> tuple[list[dict], list[dict], dict, str]:
    """(messages with the system prompt, tools, template kwargs, effort) for one session."""
    effort = session.meta.effort if session.meta.effort in cfg.efforts else cfg.default_effort
    style = cfg.efforts[effort]
    msgs = list(session.messages)
    system = cfg.system_prompt
    if msgs and msgs[0]["role"] == "system":
        if cfg.keep_session_system:
            system = msgs[0]["content"]
        msgs = msgs[1:]
    if style.system:
        system = f"{system}\n\n{style.system}" if system else style.system
    if system:
        msgs = [{"role": "system", "content": system}, *msgs]
    tools = session.tools if session.tools is not None else list(cfg.tools or pi_tools())
    return msgs, tools, dict(style.template_kwargs), effort


def _count_reasoning(ids: list[int], think_start: int | None, think_end: int | None) -> int:
    """Tokens of an assistant turn that lie inside its thinking block (before `</think>`)."""
    if think_end is None or think_end not in ids:
        return 0
    end = ids.index(think_end)
    start = ids.index(think_start) + 1 if think_start is not None and think_start in ids[:end] else 0
    return end - start


def render_session(session: Session, tok: Any, cfg: RenderConfig) -> list[Example]:
    """All examples of one session (one per run of prefix-consistent assistant turns)."""
    msgs, tools, kwargs, effort = conversation(session, cfg)
    eot = cfg.end_of_turn or tok.eos_token
    vocab = tok.get_vocab()
    think_start, think_end = vocab.get("<think>"), vocab.get("</think>")
    src = session.meta.source
    # `conversation` drops the session's own system message and puts the system prompt first, so
    # msgs[k] is session.messages[k - shift]
    shift = len(msgs) - len(session.messages)

    def render(upto: int, gen: bool) -> str:
        return tok.apply_chat_template(
            msgs[:upto], tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
        )

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []

    examples: list[Example] = []
    text, ids, mask, spans, reasoning = "", [], [], [], 0

    def flush() -> None:
        if spans:
            examples.append(
                Example(
                    input_ids=np.asarray(ids, np.int32),
                    loss_mask=np.asarray(mask, np.int32),
                    source=src,
                    effort=effort,
                    assistant_tokens=int(sum(mask)),
                    reasoning_tokens=reasoning,
                    turns=len(spans),
                    spans=tuple(spans),
                )
            )

    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(k, True)
        if not prompt.startswith(text):
            # the template rewrote earlier turns (reasoning dropped): what follows is a new sequence
            flush()
            text, ids, mask, spans, reasoning = "", [], [], [], 0
        full = render(k + 1, False)
        if not full.startswith(prompt):
            raise RenderError(
                f"{src}: message {k}: rendering the assistant turn changes its prompt",
                session.location(k - shift),
            )
        own = full[len(prompt) :]
        cut = own.find(eot)
        if cut < 0:
            raise RenderError(
                f"{src}: message {k}: no {eot!r} closes the assistant turn", session.location(k - shift)
            )
        own = own[: cut + len(eot)]  # the template's newline after it belongs to the next prompt
        # Two encodes, never one over the joined text: BPE merges across the prompt/turn boundary
        # would give ids the engine never produced (it tokenised the prompt, then sampled).
        delta = encode(prompt[len(text) :])
        turn = encode(own)
        ids += delta + turn
        mask += [0] * len(delta) + [1] * len(turn)
        spans.append((len(ids) - len(turn), len(ids)))
        reasoning += _count_reasoning(turn, think_start, think_end)
        text = prompt + own
    flush()
    return examples
