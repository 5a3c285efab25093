"""A lookup environment small enough for the tiny model to learn on CPU.

Keyed tasks (`keys_per_task >= 1`, the default) hide a short table of keys -> numbers. The model
sees only the key it must resolve, calls `get(key)` to read the value, and answers with the number:

    user:      "Value of (ka)?"
    assistant: <tool_call> get(key="ka") </tool_call>
    user:      <tool_response> 37 </tool_response>
    assistant: "37"                          -> verify: the answer's last integer == 37

Unkeyed tasks (`keys_per_task=0`, the toy-scale GRPO result's) hide one number behind a `get()`
that takes no argument; the model must call it and copy the number it reads into the answer:

    user:      "What is the value?"
    assistant: <tool_call> get() </tool_call>
    user:      <tool_response> 7 </tool_response>
    assistant: "7"

A tiny model learns the second copy (observation -> answer) but not the first (instruction ->
call; jaxpi/experiments/toy/ has the measurements), so the unkeyed form is the one whose pass rate
measures a skill the tiny model can have: with values 0-9 a guess passes 10% of the time.

Tasks come from a seed (`make_tasks(n, seed)` is deterministic), instructions and observations
are a few tokens long, and the one tool's schema is ~40 tokens (Pi's four are ~1.2k, too much
for a 512-id tokenizer and a tiny context).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpi.envs.base import Task, function_tool

TOY_SYSTEM = "Use the tool, then answer with the number."
TOY_TOOLS: tuple[dict, ...] = (function_tool("get", "Value of a key.", {"key": "string"}, ["key"]),)
UNKEYED_TOOLS: tuple[dict, ...] = (function_tool("get", "The value.", {}, []),)
UNKEYED_INSTRUCTION = "What is the value?"
UNKEYED_TARGET = "value"  # the one entry of an unkeyed task's table
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_NUMBER = re.compile(r"-?\d+")


@dataclasses.dataclass
class LookupState:
    table: dict[str, int]
    target: str
    keyed: bool = True
    calls: list[str] = dataclasses.field(default_factory=list)


def make_tasks(n: int, seed: int, *, keys_per_task: int = 3, max_value: int = 100) -> list[Task]:
    """n tasks, a pure function of (n, seed, keys_per_task, max_value); `keys_per_task=0` makes
    unkeyed tasks (`get()` without an argument returns the task's one value)."""
    if n < 0 or keys_per_task < 0 or max_value < 1:
        raise ValueError(
            f"need n >= 0, keys_per_task >= 0, max_value >= 1; got {n}, {keys_per_task}, {max_value}"
        )
    rng = np.random.default_rng(seed)
    if keys_per_task == 0:
        return [
            Task(
                task_id=f"value-{seed}-{i}",
                instruction=UNKEYED_INSTRUCTION,
                tools=UNKEYED_TOOLS,
                system=TOY_SYSTEM,
                payload={"table": {UNKEYED_TARGET: v}, "target": UNKEYED_TARGET, "keyed": False},
            )
            for i, v in enumerate(rng.integers(0, max_value, n).tolist())
        ]
    tasks = []
    for i in range(n):
        keys: list[str] = []
        while len(keys) < keys_per_task:
            k = "".join(rng.choice(list(_LETTERS), 2))
            if k not in keys:
                keys.append(k)
        values = rng.integers(0, max_value, keys_per_task).tolist()
        target = keys[int(rng.integers(keys_per_task))]
        tasks.append(
            Task(
                task_id=f"lookup-{seed}-{i}",
                # In parentheses the key is the same tokens as in the call and the reasoning
                # ("(", "k", "a", ")"); after a space the tiny tokenizer merges its first letter
                # ("Ġk"), and a tiny model then never learned to copy it.
                instruction=f"Value of ({target})?",
                tools=TOY_TOOLS,
                system=TOY_SYSTEM,
                payload={"table": dict(zip(keys, values, strict=True)), "target": target},
            )
        )
    return tasks


class LookupEnv:
    """`Environment` for `make_tasks`: `get(key)` returns the value or a one-line error; on an
    unkeyed task `get()` returns the value (an argument, if given, is ignored)."""

    def reset(self, task: Task, seed: int) -> LookupState:
        del seed  # the world is fully given by the task
        return LookupState(
            table=dict(task.payload["table"]),
            target=str(task.payload["target"]),
            keyed=bool(task.payload.get("keyed", True)),
        )

    def run_tool(self, state: LookupState, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "get":
            return f"error: no tool {name}"
        if not state.keyed:
            state.calls.append("")
            return str(state.table[state.target])
        key = str(arguments.get("key", "")).strip()
        state.calls.append(key)
        if key not in state.table:
            return f"error: no key {key}"
        return str(state.table[key])

    def verify(self, state: LookupState, final_answer: str) -> bool:
        # the last integer in the answer, so "It is 37." passes
        found = _NUMBER.findall(final_answer)
        return bool(found) and int(found[-1]) == state.table[state.target]

    def answer(self, state: LookupState) -> int:
        """The expected answer (for scripted policies and tests)."""
        return state.table[state.target]
