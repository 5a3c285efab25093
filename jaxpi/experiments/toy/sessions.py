"""SFT sessions for the LookupEnv in which low effort reasons longer than medium; the "toy_lookup"
SFT data source (`data.source: toy_lookup`, registered in pyproject.toml).

The seed report saw this after SFT: the low-effort level reasoned longer than medium, a cost-ordering
violation that effort-ordered GRPO then fixed. `toy_sessions` builds a supervised set with the same
fault on purpose, so a tiny model trained on it starts GRPO where the report's model did. On the
unkeyed tasks (`ToySFTConfig.keys_per_task=0`, the default; `get()` takes no argument):

    turn 1   <think> PHRASES </think> <tool_call> get() </tool_call>                (mask 1)
    obs      <tool_response> 7 </tool_response> ... <think>                        (mask 0)
    turn 2   <think> got it. </think> 7                                            (mask 1)

PHRASES is a fixed cycle of short phrases ("need the value.", "call get.", ...); how many of them
a session has is drawn per level so that the attempt's reasoning tokens fall in that level's range
(default low 17-68, medium 31-40, xhigh 68-90). With the tiny tokenizer 1..9 phrases give 17, 23,
31, 40, 50, 58, 68, 81, 90 tokens, so low draws 1-7 phrases (mean 41 tokens), medium 3-4 (35.5)
and xhigh 7-9 (80): low is longer than medium on average, and its spread reaches below medium,
where effort-ordered GRPO can move it (the reward is flat below the reference, so a low level
whose every length sat above medium's would stop at medium's length). Medium never stops before
phrase 3, so a KL pull to the SFT policy holds it there while the shared adapter learns to
shorten low. Keyed tasks
(`keys_per_task >= 1`) name the key in every phrase ("key (ka).") and in the call.

The rows are not rendered by hand: a scripted engine replays the intended turns through the real
agent loop (`run_attempts`), so the ids, observation deltas and masks are exactly those of a
rollout that sampled the same text, and every session is scored by the environment's verifier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.envs.agent_loop import Trajectory, run_attempts
from jaxpi.envs.toy import LookupEnv, make_tasks
from jaxpi.rollout.engine import Completion, SamplingParams, Session
from jaxpi.sft.config import DataConfig
from jaxpi.sft.data import SourceRequest

# Distinct phrases in a fixed order: which phrase comes next tells the model how far it has gone.
# The key sits in parentheses, where the tiny tokenizer splits it exactly as in the tool call
# ("\nka\n"); after a space some first letters merge with it (" n", " l"), a different token.
PHRASES = (
    "key ({k}).",
    "find ({k}).",
    "look up ({k}).",
    "call get ({k}).",
    "need ({k}).",
    "read ({k}).",
    "ask for ({k}).",
    "use ({k}).",
)
# The unkeyed tasks' cycle (`keys_per_task=0`): nothing to copy from the instruction.
PLAIN_PHRASES = (
    "need the value.",
    "call get.",
    "read the reply.",
    "copy the number.",
    "check it once.",
    "then answer.",
    "no key here.",
    "one call is enough.",
)
SECOND_THOUGHT = "got it."  # turn 2's reasoning, the same in every session
DEFAULT_REASONING: Mapping[str, tuple[int, int]] = MappingProxyType(
    {"low": (17, 68), "medium": (31, 40), "xhigh": (68, 90)}
)
END_OF_TURN = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class ToySFTConfig:
    """Which levels, how long each reasons (attempt reasoning tokens, inclusive), the task shape."""

    levels: tuple[str, ...] = ("low", "medium", "xhigh")
    reasoning: Mapping[str, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_REASONING)
    )
    keys_per_task: int = 0  # 0: unkeyed tasks, `get()` (the toy result's); >= 1: `get(key)`
    max_value: int = 10

    def __post_init__(self) -> None:
        reasoning = {str(k): (int(v[0]), int(v[1])) for k, v in dict(self.reasoning).items()}
        object.__setattr__(self, "reasoning", MappingProxyType(reasoning))
        object.__setattr__(self, "levels", tuple(self.levels))
        errors = []
        if not self.levels:
            errors.append("levels must name at least one effort level")
        for level in self.levels:
            if level not in reasoning:
                errors.append(f"level {level!r} has no reasoning range (have {sorted(reasoning)})")
        for level, (lo, hi) in reasoning.items():
            if not 1 <= lo <= hi:
                errors.append(f"reasoning range of {level!r} must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
        if self.keys_per_task < 0 or self.max_value < 1:
            errors.append(
                f"keys_per_task must be >= 0 and max_value >= 1, got {self.keys_per_task}, {self.max_value}"
            )
        if errors:
            raise ValueError("; ".join(errors))


def tool_call(key: str | None) -> str:
    """The qwen3-coder XML the chat template teaches for `get(key=...)` (`get()` for key None)."""
    if key is None:
        return "<tool_call>\n<function=get>\n</function>\n</tool_call>"
    return f"<tool_call>\n<function=get>\n<parameter=key>\n{key}\n</parameter>\n</function>\n</tool_call>"


def filler(key: str | None, n: int) -> str:
    """The first n phrases of the cycle, naming `key` (the plain cycle for key None)."""
    if key is None:
        return " ".join(PLAIN_PHRASES[i % len(PLAIN_PHRASES)] for i in range(n))
    return " ".join(PHRASES[i % len(PHRASES)].format(k=key) for i in range(n))


def script(key: str | None, value: int, phrases: int) -> tuple[str, str]:
    """The two assistant turns, as sampled text (the generation prompt already opened `<think>`)."""
    first = f"{filler(key, phrases)}\n</think>\n\n{tool_call(key)}{END_OF_TURN}"
    second = f"{SECOND_THOUGHT}\n</think>\n\n{value}{END_OF_TURN}"
    return first, second


def reasoning_tokens(tokenizer: Any, key: str | None, phrases: int) -> int:
    """Reasoning tokens of a scripted attempt (both turns), counted as the agent loop counts them:
    the text before `</think>`, its trailing newline included."""

    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return n(f"{filler(key, phrases)}\n") + n(f"{SECOND_THOUGHT}\n")


def pick_phrases(tokenizer: Any, key: str | None, span: tuple[int, int], rng: np.random.Generator) -> int:
    """A phrase count, uniform over those whose attempt reasoning falls in `span`."""
    lo, hi = span
    fits = []
    for k in range(1, 64):
        t = reasoning_tokens(tokenizer, key, k)
        if t > hi:
            break
        if t >= lo:
            fits.append(k)
    if not fits:
        raise ValueError(
            f"no phrase count gives key {key!r} reasoning in [{lo}, {hi}] tokens; widen the range"
        )
    return int(fits[int(rng.integers(len(fits)))])


class _Replay:
    """A `RolloutEngine` that emits pre-written turns (tokenised whole), one script per session."""

    def __init__(self, tokenizer: Any, scripts: Sequence[Sequence[str]]):
        self.tok, self.scripts = tokenizer, [list(s) for s in scripts]
        self.held: list[list[int]] = []

    def generate(self, prompts: Any, params: SamplingParams) -> list[Completion]:
        raise NotImplementedError("the agent loop uses sessions")

    def start(self, prompts: Sequence[Sequence[int]]) -> list[Session]:
        self.held += [list(p) for p in prompts]
        return [Session(len(self.held) - len(prompts) + i) for i in range(len(prompts))]

    def continue_(
        self, sessions: Sequence[Session], observations: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        out = []
        for s, obs in zip(sessions, observations, strict=True):
            self.held[s.id] += list(obs)
            ids = list(self.tok(self.scripts[s.id].pop(0), add_special_tokens=False)["input_ids"])
            if len(ids) > params.max_new_tokens:
                raise ValueError(
                    f"scripted turn of {len(ids)} tokens exceeds the turn budget {params.max_new_tokens}"
                )
            out.append(Completion(ids, [0.0] * len(ids), [0.0] * len(ids), "stop", len(self.held[s.id])))
            self.held[s.id] += ids
        return out

    def close(self, sessions: Sequence[Session]) -> None:
        pass


def toy_trajectories(
    n: int,
    seed: int,
    tokenizer: Any,
    *,
    cfg: ToySFTConfig | None = None,
    render_cfg: RenderConfig | None = None,
) -> list[Trajectory]:
    """n scripted sessions (tasks from `make_tasks(n, seed)`, levels in turn), through the agent loop.

    A pure function of (n, seed, cfg, tokenizer). Raises if any session fails its verifier or does
    not end with an answer: every row must be one the SFT gate would admit.
    """
    cfg = cfg or ToySFTConfig()
    render_cfg = render_cfg or RenderConfig(tokenizer.name_or_path)
    rng = np.random.default_rng([seed, 1])  # the task draws use `seed` itself
    tasks = make_tasks(n, seed, keys_per_task=cfg.keys_per_task, max_value=cfg.max_value)
    jobs, scripts = [], []
    for i, task in enumerate(tasks):
        level = cfg.levels[i % len(cfg.levels)]
        target = str(task.payload["target"])
        value = int(task.payload["table"][target])
        key = target if task.payload.get("keyed", True) else None
        jobs.append((task, level))
        scripts.append(script(key, value, pick_phrases(tokenizer, key, cfg.reasoning[level], rng)))
    trajs = run_attempts(
        _Replay(tokenizer, scripts),
        tokenizer,
        jobs,
        SamplingParams(temperature=0.0, max_new_tokens=4096),
        env=LookupEnv(),
        render_cfg=render_cfg,
        max_turns=2,
        max_tokens=8192,
    )
    for t in trajs:
        if t.finish_reason != "answer" or not t.success:
            raise RuntimeError(
                f"scripted session {t.task_id} at {t.level} ended {t.finish_reason!r} "
                f"(success={t.success}, reason={t.reason}); the script does not fit the template"
            )
    return trajs


def toy_sessions(
    n: int,
    seed: int,
    tokenizer: Any,
    *,
    cfg: ToySFTConfig | None = None,
    render_cfg: RenderConfig | None = None,
) -> list[dict[str, Any]]:
    """SFT examples `{"input_ids", "loss_mask", "session_id", "level", "reasoning_tokens"}`
    (int32 arrays; mask 1 exactly on the scripted assistant turns), one per session."""
    out = []
    for t in toy_trajectories(n, seed, tokenizer, cfg=cfg, render_cfg=render_cfg):
        out.append(
            {
                "input_ids": np.asarray(t.token_ids, np.int32),
                "loss_mask": np.asarray(t.mask, np.int32),
                "session_id": t.task_id,
                "level": t.level,
                "reasoning_tokens": t.reasoning_tokens,
            }
        )
    return out


# ---- the SFT data source -------------------------------------------------------------------------
def toy_config(data: DataConfig) -> ToySFTConfig:
    """The `ToySFTConfig` of an SFT run's `data:` section (toy_levels, toy_reasoning, toy_max_value;
    validates the ranges)."""
    if not data.toy_reasoning:
        return ToySFTConfig(levels=data.toy_levels, max_value=data.toy_max_value)
    r = data.toy_reasoning
    spans = {lv: (r[2 * i], r[2 * i + 1]) for i, lv in enumerate(data.toy_levels)}
    return ToySFTConfig(levels=data.toy_levels, reasoning=spans, max_value=data.toy_max_value)


def toy_lookup_source(request: SourceRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`data.source: toy_lookup` (a `jaxpi.sft_sources` entry point): `data.toy_examples` scripted
    sessions drawn with the run's seed, and the reasoning range of each level for the report."""
    d, tok_dir = request.data, request.tokenizer_dir
    toy = toy_config(d)
    examples = toy_sessions(
        d.toy_examples, request.seed, load_tokenizer(tok_dir), cfg=toy, render_cfg=RenderConfig(tok_dir)
    )
    spans = {lv: list(toy.reasoning[lv]) for lv in toy.levels}
    return examples, {"source": "toy_lookup", "examples": len(examples), "reasoning": spans}
