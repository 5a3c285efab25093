"""Each model family's jaxpi module class, by family name (`jaxpi.config.FAMILIES`): what every
loader, trainer and engine builds a model with (`model_class(cfg)(cfg, dtype=..., rngs=...)`)."""

from __future__ import annotations

from jaxpi.config import FAMILIES, QwenConfig
from jaxpi.models.qwen3 import Qwen3ForCausalLM
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

# One entry per family of `jaxpi.config.FAMILIES` (tests/test_qwen3.py checks that they agree).
MODELS: dict[str, type[Qwen3_5ForCausalLM]] = {"qwen3_5": Qwen3_5ForCausalLM, "qwen3": Qwen3ForCausalLM}


def model_class(cfg: QwenConfig) -> type[Qwen3_5ForCausalLM]:
    """The module class of `cfg`'s family."""
    try:
        return MODELS[cfg.family]
    except KeyError:
        raise ValueError(f"no model class for family {cfg.family!r}; known: {sorted(FAMILIES)}") from None
