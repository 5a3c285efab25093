"""The rollout-engine interface: what GRPO asks of any engine (embedded JAX now, vLLM later).

An engine samples continuations of token-id prompts and returns, for every sampled token, its id
and its log-probability under the **raw model** (temperature 1, no top-p filter): GRPO's
importance correction compares exactly that number with the trainer's recomputed log-probability,
so an engine that reported the processed (tempered / truncated) distribution would bias it.
The processed log-probability (the distribution the token was actually drawn from) is returned
beside it for diagnostics.

Multi-turn sessions keep the context alive between turns: `start` opens sessions on prompts,
`continue_` appends observation tokens (a tool result, a user message) and samples the next turn
on top of what the session already holds (the engine prefills only the new tokens), `close`
frees them. `generate` is the one-turn shorthand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn.

    `temperature` 0 means greedy (argmax). `top_p` < 1 keeps the smallest set of most likely tokens
    whose probability (after temperature) reaches `top_p`. A row ends after `max_new_tokens`
    tokens ("length"), or at the first token in `stop_token_ids` ("stop"; the stop token is part of
    the output, since it is part of what the model generated and the trainer scores it). `seed`
    makes sampling deterministic: the same seed, prompts and weights give the same tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        stops = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled turn.

    `logprobs[i]` is log π(token_ids[i] | context) under the raw model distribution (temperature 1,
    unfiltered), computed in float32 from the same forward pass that sampled the token.
    `sampling_logprobs[i]` is the log-probability under the processed distribution the token was
    drawn from (temperature and top-p applied; 0.0 for greedy). `prompt_len` is the number of
    tokens the session held before this turn (prompt, earlier turns and observations).
    """

    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    finish_reason: FinishReason
    prompt_len: int


@dataclasses.dataclass(frozen=True)
class Session:
    """A live multi-turn context inside an engine (an opaque handle to callers)."""

    id: int


@runtime_checkable
class RolloutEngine(Protocol):
    """What GRPO's rollout loop calls; every list is index-aligned with its input list."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """One turn per prompt; no state is kept afterwards."""
        ...

    def start(self, prompts: Sequence[Sequence[int]]) -> list[Session]:
        """Open one session per prompt; nothing is sampled until `continue_`."""
        ...

    def continue_(
        self,
        sessions: Sequence[Session],
        observations: Sequence[Sequence[int]],
        params: SamplingParams,
    ) -> list[Completion]:
        """Append each observation (may be empty, e.g. for the first turn) to its session, then
        sample the next turn. The sampled tokens stay in the session's context."""
        ...

    def close(self, sessions: Sequence[Session]) -> None:
        """Free the sessions' resources; closed handles are invalid afterwards."""
        ...
