"""The multi-turn agent loop: batched attempts on any `RolloutEngine`, kept as token-exact trajectories.

One attempt is one session in the engine. Its token ids are exactly what the engine held, in order,
with a mask that is 1 on the tokens the model sampled and 0 on everything the loop fed it:

    | prompt (system, tools, user, gen prompt) | turn 1 | observation 1 | turn 2 | ... | turn n |
    |  0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 | 1 1 1 1 | 0 0 0 0 0 0 0 | 1 1 1 1|     | 1 1 1  |
    logprobs: engine raw-model log π(token) under the 1s, 0.0 under the 0s

An observation is the text the chat template puts between the end of an assistant turn
(`<|im_end|>`) and the next generation prompt: the difference of two renders,

    turn_end = render(msgs + [assistant]) cut right after the assistant's end-of-turn token
    next     = render(msgs + [assistant] + tool results, add_generation_prompt=True)
    delta    = next[len(turn_end):]              # "\\n<|im_start|>user\\n<tool_response>..."

tokenised on its own (never merged with neighbouring text), so the session is the sequence a fresh
render of the conversation gives wherever the template's prefixes are consistent.

Each round continues only the live sessions (grouped by their remaining turn budget, since a
call shares one `SamplingParams`). An attempt ends on a final answer (a well-formed turn without
tool calls; then the verifier runs), a malformed turn (not admitted), a "length" finish, the turn
budget or the token budget (admitted failures: the model ran out of room, which GRPO must see).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

from jaxpi.data.render import RenderConfig
from jaxpi.envs.base import Attempt, Environment, Task
from jaxpi.envs.toolcalls import ParsedTurn, count_reasoning_tokens, parse_turn
from jaxpi.rollout.engine import RolloutEngine, SamplingParams

EndReason = Literal["answer", "malformed", "length", "max_turns", "max_tokens"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One attempt, token-exact (see the module docstring for the layout).

    `output_tokens` counts sampled tokens (sum of `mask`); `reasoning_tokens` those inside
    thinking blocks only. `tool_calls` counts the well-formed tool calls that ran (None where the
    producer did not count them). `finish_reason`: "answer" (a final answer, verified), "malformed",
    "length" (a turn or the context ran out), "max_turns", "max_tokens" (the attempt's sampled-token
    budget). `admitted` is False exactly for malformed attempts; `reason` says why an attempt
    ended other than with an answer. `messages` is the conversation as chat messages (tool results
    included), for re-rendering.
    """

    task_id: str
    level: str
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    reasoning_tokens: int
    output_tokens: int
    turns: int
    finish_reason: EndReason
    success: bool
    malformed: bool
    reason: str | None = None
    final_answer: str | None = None
    messages: tuple[dict, ...] = ()
    attempt_id: str | None = None
    tool_calls: int | None = None

    @property
    def admitted(self) -> bool:
        return not self.malformed

    def to_attempt(self) -> Attempt:
        return Attempt(
            task_id=self.task_id,
            level=self.level,
            success=self.success,
            reasoning_tokens=self.reasoning_tokens,
            attempt_id=self.attempt_id,
            admitted=self.admitted,
            output_tokens=self.output_tokens,
            turns=self.turns,
            tool_calls=self.tool_calls,
        )


@dataclasses.dataclass
class _Run:
    """Mutable per-attempt bookkeeping while the batch is live."""

    task: Task
    level: str
    env_state: Any
    msgs: list[dict]
    kwargs: dict
    max_turns: int
    max_tokens: int
    thinking_open: bool
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    pending: list[int] = dataclasses.field(default_factory=list)  # observation for the next turn
    reasoning: int = 0
    output: int = 0
    turns: int = 0
    tool_calls: int = 0  # well-formed calls run through env.run_tool
    end: EndReason | None = None
    success: bool = False
    malformed: bool = False
    reason: str | None = None
    answer: str | None = None


class _Template:
    """The tokenizer's chat template over one task's conversation."""

    def __init__(self, tokenizer: Any, end_of_turn: str):
        self.tok, self.eot = tokenizer, end_of_turn

    def render(self, run: _Run, msgs: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(
            msgs, tools=list(run.task.tools), add_generation_prompt=gen, tokenize=False, **run.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def observation(self, run: _Run, assistant: dict, results: list[dict]) -> str:
        """The text between the assistant turn's end-of-turn token and the next generation prompt."""
        full = self.render(run, [*run.msgs, assistant], False)
        cut = full.rfind(self.eot)
        if cut < 0:
            raise ValueError(
                f"task {run.task.task_id}: the template ends no assistant turn with {self.eot!r}"
            )
        turn_end = full[: cut + len(self.eot)]
        nxt = self.render(run, [*run.msgs, assistant, *results], True)
        if not nxt.startswith(turn_end):
            raise ValueError(
                f"task {run.task.task_id}: the template re-renders earlier turns once tool results follow; "
                "the observation delta is undefined"
            )
        return nxt[len(turn_end) :]


def initial_messages(task: Task, level: str, render_cfg: RenderConfig) -> tuple[list[dict], dict]:
    """(system + user messages, template kwargs) for a task at an effort level."""
    if level not in render_cfg.efforts:
        raise ValueError(
            f"effort level {level!r} is not in the render config's efforts {sorted(render_cfg.efforts)}"
        )
    style = render_cfg.efforts[level]
    system = task.system if task.system is not None else render_cfg.system_prompt
    if style.system:
        system = f"{system}\n\n{style.system}" if system else style.system
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": task.instruction})
    return msgs, dict(style.template_kwargs)


def run_attempts(
    engine: RolloutEngine,
    tokenizer: Any,
    tasks_with_levels: Sequence[tuple[Task, str]],
    params: SamplingParams,
    *,
    env: Environment,
    render_cfg: RenderConfig,
    max_turns: int = 4,
    max_tokens: int = 1024,
    max_context: int | None = None,
    seed: int = 0,
    on_end: Callable[[bool, int], Any] | None = None,
) -> list[Trajectory]:
    """Run one attempt per (task, level), all sessions batched, and score each once.

    `params` sets temperature / top-p / seed and caps each turn (`max_new_tokens`); the end-of-turn
    token is always a stop token. `max_tokens` caps sampled tokens per attempt (over all turns),
    `max_context` the session length (default: the engine's `max_len`, when it has one); a task's
    own `limits` tighten both budgets. `seed` is handed to `env.reset` (plus the attempt's index).
    `on_end(success, sampled tokens)` is called as each attempt ends (a collection's progress).
    """
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"max_turns and max_tokens must be >= 1, got {max_turns}, {max_tokens}")
    eot = render_cfg.end_of_turn or tokenizer.eos_token
    vocab = tokenizer.get_vocab()
    if eot not in vocab:
        raise ValueError(f"end-of-turn token {eot!r} is not a single token of the tokenizer")
    eot_id, think_open, think_close = vocab[eot], vocab.get("<think>", -1), vocab.get("</think>", -1)
    stops = tuple(dict.fromkeys((*params.stop_token_ids, eot_id)))
    max_context = max_context if max_context is not None else getattr(engine, "max_len", None)
    tpl = _Template(tokenizer, eot)

    runs: list[_Run] = []
    for i, (task, level) in enumerate(tasks_with_levels):
        msgs, kwargs = initial_messages(task, level, render_cfg)
        run = _Run(
            task=task,
            level=level,
            env_state=env.reset(task, seed + i),
            msgs=msgs,
            kwargs=kwargs,
            max_turns=min(max_turns, task.limits.max_turns or max_turns),
            max_tokens=min(max_tokens, task.limits.max_tokens or max_tokens),
            thinking_open=False,
            ids=[],
            mask=[],
            logprobs=[],
            prompt_len=0,
        )
        prompt = tpl.render(run, msgs, True)
        # A generation prompt that opens `<think>` means the sampled text starts inside the block.
        run.thinking_open = prompt.rstrip("\n").endswith("<think>")
        run.ids = tpl.encode(prompt)
        run.mask, run.logprobs, run.prompt_len = [0] * len(run.ids), [0.0] * len(run.ids), len(run.ids)
        if max_context is not None and run.prompt_len >= max_context:
            raise ValueError(
                f"task {task.task_id} at {level}: the prompt has {run.prompt_len} tokens, "
                f"no room left in a context of {max_context}"
            )
        runs.append(run)
    if not runs:
        return []

    sessions = engine.start([r.ids for r in runs])
    try:
        round_ = 0
        while True:
            live = [i for i, r in enumerate(runs) if r.end is None]
            if not live:
                break
            groups: dict[int, list[int]] = {}
            for i in live:
                r = runs[i]
                room = r.max_tokens - r.output
                if room < 1:
                    r.end, r.reason = "max_tokens", f"{r.output} sampled tokens spent the attempt's budget"
                    continue
                if max_context is not None:
                    room = min(room, max_context - len(r.ids) - len(r.pending))
                    if room < 1:  # the observation would fill the context: nothing left to sample
                        r.end, r.reason = "length", f"no room left in a context of {max_context} tokens"
                        continue
                groups.setdefault(min(params.max_new_tokens, room), []).append(i)
            for g, (budget, members) in enumerate(sorted(groups.items())):
                sp = dataclasses.replace(
                    params, max_new_tokens=budget, stop_token_ids=stops, seed=params.seed + 7919 * round_ + g
                )
                comps = engine.continue_(
                    [sessions[i] for i in members], [runs[i].pending for i in members], sp
                )
                for i, comp in zip(members, comps, strict=True):
                    _take_turn(runs[i], comp, tpl, env, think_open, think_close)
            if on_end is not None:
                for i in live:
                    if runs[i].end is not None:
                        on_end(runs[i].success, runs[i].output)
            round_ += 1
    finally:
        engine.close(sessions)

    out = []
    for i, r in enumerate(runs):
        out.append(
            Trajectory(
                task_id=r.task.task_id,
                level=r.level,
                token_ids=r.ids,
                mask=r.mask,
                logprobs=r.logprobs,
                prompt_len=r.prompt_len,
                reasoning_tokens=r.reasoning,
                output_tokens=r.output,
                turns=r.turns,
                finish_reason=r.end or "max_turns",
                success=r.success,
                malformed=r.malformed,
                reason=r.reason,
                final_answer=r.answer,
                messages=tuple(r.msgs),
                attempt_id=f"{r.task.task_id}/{r.level}/{seed + i}",
                tool_calls=r.tool_calls,
            )
        )
    return out


def _take_turn(
    run: _Run, comp: Any, tpl: _Template, env: Environment, think_open: int, think_close: int
) -> None:
    """Record one sampled turn, then end the attempt or queue its observation."""
    run.ids += run.pending
    run.mask += [0] * len(run.pending)
    run.logprobs += [0.0] * len(run.pending)
    run.pending = []
    toks = list(comp.token_ids)
    run.ids += toks
    run.mask += [1] * len(toks)
    run.logprobs += [float(x) for x in comp.logprobs]
    run.output += len(toks)
    run.turns += 1
    run.reasoning += count_reasoning_tokens(toks, think_open, think_close, thinking_open=run.thinking_open)
    if comp.finish_reason == "length":
        run.end, run.reason = "length", "the turn hit its token budget before the end-of-turn token"
        return
    text = tpl.tok.decode(toks, skip_special_tokens=False)
    turn: ParsedTurn = parse_turn(text, run.task.tools, thinking_open=run.thinking_open, end_of_turn=tpl.eot)
    if turn.error is not None:
        run.end, run.malformed, run.reason = "malformed", True, turn.error
        return
    assistant = turn.message()
    if turn.is_final:
        run.msgs.append(assistant)
        run.end, run.answer = "answer", turn.content
        run.success = bool(env.verify(run.env_state, turn.content))
        return
    if run.turns >= run.max_turns:
        run.msgs.append(assistant)
        run.end, run.reason = "max_turns", f"no final answer within {run.max_turns} turns"
        return
    results = [
        {"role": "tool", "name": c.name, "content": env.run_tool(run.env_state, c.name, c.arguments)}
        for c in turn.tool_calls
    ]
    run.tool_calls += len(results)
    run.pending = tpl.encode(tpl.observation(run, assistant, results))
    run.msgs += [assistant, *results]
