"""A tiny model that says a scripted conversation: for testing agent harnesses against `jaxpi serve`.

A random tiny checkpoint never emits a well-formed tool call, so a harness, the gateway or the
trajectory builder cannot be exercised end to end on it. `fit_head` solves a tiny model's LM head
(closed form, no training loop) on one conversation, in the exact token layout the server
produces (the prompt tokenised as one text, each turn's tokens after it), so that greedy
decoding replays the script. Served at temperature 0 it then answers the script's user and tool
messages with the script's reasoning, tool calls and final answer, through the real engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.convert.hf import load_hf
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.serve.chat import ChatFormat
from jaxpi.serve.protocol import read_chat_request


@dataclasses.dataclass(frozen=True)
class Script:
    """Token layout of one scripted conversation (as the server will see it).

    ids: the whole conversation's tokens; spans: [start, end) of each assistant turn; prompts:
    the token length of each turn's prompt (= the turn's start).
    """

    ids: list[int]
    spans: tuple[tuple[int, int], ...]
    texts: tuple[str, ...]  # each turn's text (reasoning, content, calls, end-of-turn token)


def script_layout(
    tok: Any, messages: Sequence[dict], tools: Sequence[dict], template_kwargs: dict, eot: str
) -> Script:
    """Render the conversation turn by turn; every prompt must extend the previous prompt + turn."""
    msgs = list(messages)

    def render(upto: int, gen: bool) -> str:
        return tok.apply_chat_template(
            msgs[:upto],
            tools=list(tools) or None,
            add_generation_prompt=gen,
            tokenize=False,
            **template_kwargs,
        )

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    text, spans, texts = "", [], []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(k, True)
        if not prompt.startswith(text):
            raise ValueError(
                f"message {k}: the template re-renders earlier turns; the script is not one sequence"
            )
        full = render(k + 1, False)
        own = full[len(prompt) :]
        own = own[: own.index(eot) + len(eot)]
        start, end = len(encode(prompt)), len(encode(prompt + own))
        if encode(prompt + own)[:start] != encode(prompt):
            raise ValueError(f"message {k}: the turn's first tokens merge with the prompt's last ones")
        spans.append((start, end))
        texts.append(own)
        text = prompt + own
    return Script(encode(text), tuple(spans), tuple(texts))


def fit_head(model: Any, script: Script, *, margin: float = 8.0) -> dict[str, float]:
    """Solve the LM head (in place) so that greedy decoding replays the script's turns.

    With H [n, d] the final hidden states at the n positions that predict a supervised token,
    W [d, V] the head, and E [n, V] zero except `E[t, target_t]` = the amount that lifts the
    target `margin` above the row's largest other logit, the minimum-norm correction solving
    `H @ dW = E` is `dW = pinv(H) @ E`: every other logit at those positions stays as it was.
    It is exact when H has full row rank (n <= d, hidden states in general position), so the
    model needs `hidden_size` >= the script's supervised tokens. Only the head changes; prompts
    outside the script get the random model's behaviour. Returns the greedy accuracy after.
    """
    import jax.numpy as jnp

    ids = np.asarray(script.ids, np.int32)
    rows = np.asarray([t - 1 for a, b in script.spans for t in range(a, b)])  # predictors of ids[a:b]
    targets = ids[rows + 1]
    d = model.cfg.hidden_size
    if model.lm_head is None:
        raise ValueError("fit_head needs an untied LM head (tie_word_embeddings=False)")
    if len(rows) > d:
        raise ValueError(
            f"the script supervises {len(rows)} tokens; fit_head needs hidden_size >= that, got {d}"
        )
    from flax import nnx

    hidden = nnx.jit(lambda m, x: m.hidden_states(x)[0])(model, jnp.asarray(ids[None]))  # [1, T, d]
    h = np.asarray(hidden[0], np.float64)[rows]  # [n, d]
    w = np.asarray(model.lm_head[...], np.float64)  # [d, V]
    logits = h @ w  # [n, V]
    others = logits.copy()
    others[np.arange(len(rows)), targets] = -np.inf
    e = np.zeros_like(logits)
    e[np.arange(len(rows)), targets] = others.max(-1) + margin - logits[np.arange(len(rows)), targets]
    dw = np.linalg.pinv(h) @ e  # [d, V], the minimum-norm solution of h @ dw = e
    model.lm_head[...] = jnp.asarray(w + dw, model.lm_head[...].dtype)
    new = h @ (w + dw)
    return {"supervised": float(len(rows)), "greedy_accuracy": float(np.mean(new.argmax(-1) == targets))}


def lookup_script() -> tuple[list[dict], list[dict], str]:
    """(messages, tools, effort) of a two-turn tool conversation: look a key up, then answer.

    The messages are the client's (no effort line); the server adds "Reasoning effort: low."
    to the system message, as it does for any request at that level.
    """
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": "Value of a key.",
                "parameters": {
                    "type": "object",
                    "properties": {"key": {"type": "string"}},
                    "required": ["key"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You look up keys."},
        {"role": "user", "content": "What is ab?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "find ab",
            "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"key": "ab"}}}],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "ok"},
    ]
    return messages, tools, "low"


def scripted_model(
    ckpt_dir: Any, messages: Sequence[dict], tools: Sequence[dict], effort: str
) -> tuple[Any, Script]:
    """Load a HF checkpoint (with its tokenizer) and solve its head to replay the conversation as
    `jaxpi serve` renders it at `effort`. Returns (model, script layout)."""
    tok = load_tokenizer(str(ckpt_dir))
    fmt = ChatFormat(tok, RenderConfig(tokenizer_dir=str(ckpt_dir)))
    req = read_chat_request(
        {"messages": list(messages), "tools": list(tools), "reasoning_effort": effort},
        served="",
        efforts=fmt.efforts,
        vocab_size=1 << 30,
    )
    msgs, kwargs, _ = fmt.messages(req)
    script = script_layout(tok, msgs, tools, kwargs, fmt.eot)
    _, model = load_hf(ckpt_dir)
    stats = fit_head(model, script)
    if stats["greedy_accuracy"] < 1.0:
        raise ValueError(f"the head fit does not replay the script: {stats}")
    return model, script
