"""Rollout engines for GRPO: the interface, and the embedded JAX engine."""

from jaxpi.rollout.engine import Completion, FinishReason, RolloutEngine, SamplingParams, Session
from jaxpi.rollout.jax_engine import JaxEngine

__all__ = ["Completion", "FinishReason", "JaxEngine", "RolloutEngine", "SamplingParams", "Session"]
