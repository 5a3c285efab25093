"""Each model family's jaxpi module class, by family name (`jaxpi.config.FAMILIES`): what every
loader, trainer and engine builds a model with (`model_class(cfg)(cfg, dtype=..., rngs=...)`)."""

from __future__ import annotations

from jaxpi.config import FAMILIES, QwenConfig
from jaxpi.models.qwen3 import Qwen3ForCausalLM
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

MODELS: dict[str, type[Qwen3_5ForCausalLM]] = {"qwen3_5": Qwen3_5ForCausalLM, "qwen3": Qwen3ForCausalLM}
assert set(MODELS) == set(FAMILIES), "every family in jaxpi.config.FAMILIES has a model class"


def model_class(cfg: QwenConfig) -> type[Qwen3_5ForCausalLM]:
    """The module class of `cfg`'s family."""
    return MODELS[cfg.family]
