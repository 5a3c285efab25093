"""What a GRPO task is, and what an environment must do for the agent loop.

A `Task` is data: an id, the user's instruction, the tools listed to the model (OpenAI-style
schemas), an optional system prompt of its own, optional per-task budgets, and `payload`, the
environment's private facts (the answer, the file contents) that the model never sees.

An `Environment` is behaviour over a per-attempt state:

    state = env.reset(task, seed)             # fresh world for one attempt
    text  = env.run_tool(state, name, args)   # one tool call -> observation text
    ok    = env.verify(state, final_answer)   # the verifier, called once per attempt

Tool errors a real harness would show the model (a missing key, a bad path) are observations,
not exceptions; calls that do not parse never reach the environment (the loop flags them).

An `Attempt` is what the reward (`jaxpi.rl.reward`) reads of one finished attempt: its outcome and
reasoning length, whether it was admitted, and (when the harness counts them) its tool calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Limits:
    """Per-task budgets; None defers to the caller's (`run_attempts`) budget."""

    max_turns: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"Limits.{name} must be >= 1 or None, got {v}")


@dataclass(frozen=True)
class Task:
    task_id: str
    instruction: str
    tools: tuple[Mapping[str, Any], ...]
    system: str | None = None  # None: the render config's system prompt
    limits: Limits = field(default_factory=Limits)
    payload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("Task.task_id must be non-empty")
        if not self.instruction:
            raise ValueError(f"task {self.task_id}: instruction must be non-empty")
        tools = tuple(self.tools)
        for t in tools:
            fn = t.get("function", t)
            if "name" not in fn:
                raise ValueError(f"task {self.task_id}: a tool schema has no name: {t}")
        object.__setattr__(self, "tools", tools)
        object.__setattr__(self, "payload", MappingProxyType(dict(self.payload)))

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t.get("function", t)["name"] for t in self.tools)


@dataclass(frozen=True)
class Attempt:
    """One complete session (agent loop or Pi) on a task at an effort level, scored once by the
    task's verifier.

    `reasoning_tokens` counts tokens inside thinking blocks summed over turns (not answers, tool
    calls or observations). `output_tokens` and `turns` are optional and only feed the per-level
    summary. `tool_calls` is the number of tool calls the attempt ran (None: not counted); it feeds
    the summary and `RewardConfig.tool_bonus`, which gives an attempt without a count no bonus.
    `malformed` marks a non-admitted attempt whose own output broke the format (never a
    success); `RewardConfig.malformed` decides whether it counts as a failure in its group.
    """

    task_id: str
    level: str
    success: bool
    reasoning_tokens: int
    attempt_id: str | None = None
    admitted: bool = True
    output_tokens: int | None = None
    turns: int | None = None
    malformed: bool = False
    tool_calls: int | None = None


@runtime_checkable
class Environment(Protocol):
    def reset(self, task: Task, seed: int) -> Any:
        """A fresh per-attempt state."""
        ...

    def run_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        """Run one well-formed tool call; the observation text goes back to the model."""
        ...

    def verify(self, state: Any, final_answer: str) -> bool:
        """The task's verifier on the attempt's final answer (the last turn's content)."""
        ...


def function_tool(name: str, description: str, params: Mapping[str, str], required: Sequence[str]) -> dict:
    """An OpenAI-style schema; `params` maps argument name -> JSON type."""
    props = {k: {"type": v} for k, v in params.items()}
    parameters = {"type": "object", "properties": props, "required": list(required)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
