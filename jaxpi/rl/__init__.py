"""GRPO pieces as pure functions: the effort-ordered reward and its advantages (`jaxpi.rl.reward`),
the clipped policy loss (`jaxpi.rl.loss`)."""

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

# The loss is exported where its module is present; only that module's absence is tolerated, so an
# error raised inside it still surfaces here.
try:
    from jaxpi.rl.loss import GRPOLossConfig, grpo_loss
except ModuleNotFoundError as e:
    if e.name != "jaxpi.rl.loss":
        raise
else:
    __all__ += ["GRPOLossConfig", "grpo_loss"]
