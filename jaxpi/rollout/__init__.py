"""Rollout engines for GRPO: the interface, and the embedded JAX engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxpi.rollout.engine import Completion, FinishReason, RolloutEngine, SamplingParams, Session
    from jaxpi.rollout.jax_engine import JaxEngine

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "Completion": "jaxpi.rollout.engine",
    "FinishReason": "jaxpi.rollout.engine",
    "RolloutEngine": "jaxpi.rollout.engine",
    "SamplingParams": "jaxpi.rollout.engine",
    "Session": "jaxpi.rollout.engine",
    "JaxEngine": "jaxpi.rollout.jax_engine",
}

__all__ = ["Completion", "FinishReason", "JaxEngine", "RolloutEngine", "SamplingParams", "Session"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxpi.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
