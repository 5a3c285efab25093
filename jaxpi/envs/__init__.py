"""GRPO environments: tasks, the multi-turn agent loop over a rollout engine, and a toy environment."""

from jaxpi.envs.agent_loop import Trajectory, initial_messages, run_attempts
from jaxpi.envs.base import Environment, Limits, Task, function_tool
from jaxpi.envs.toolcalls import ParsedTurn, ToolCall, parse_turn
from jaxpi.envs.toy import LookupEnv, make_tasks

__all__ = [
    "Environment",
    "Limits",
    "LookupEnv",
    "ParsedTurn",
    "Task",
    "ToolCall",
    "Trajectory",
    "function_tool",
    "initial_messages",
    "make_tasks",
    "parse_turn",
    "run_attempts",
]
