"""Rollout engines for GRPO: the interface, and the embedded JAX engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

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


__getattr__, __dir__ = facade(__name__, _WHERE, globals())
