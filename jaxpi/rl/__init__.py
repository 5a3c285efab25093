"""GRPO pieces as pure functions: the effort-ordered reward and its advantages (`jaxpi.rl.reward`)."""

from jaxpi.rl.reward import (
    KINDS,
    PHI,
    Attempt,
    CollectionScore,
    LevelSummary,
    RewardConfig,
    advantages,
    applicable_reference,
    phi,
    references,
    rewards,
    score_collection,
)

__all__ = [
    "KINDS",
    "PHI",
    "Attempt",
    "CollectionScore",
    "LevelSummary",
    "RewardConfig",
    "advantages",
    "applicable_reference",
    "phi",
    "references",
    "rewards",
    "score_collection",
]
