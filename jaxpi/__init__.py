"""jaxpi: Qwen3.5 (and Qwen3 dense) in JAX/Flax NNX, fine-tuned into a coding agent for the Pi harness.

The names below are imported on first use (PEP 562), so `import jaxpi.<anything>` and the light
commands do not pay for jax and flax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxpi.config import QWEN3_5_9B, QWEN3_5_27B, QWEN3_8B, QWEN3_TINY, TINY, QwenConfig, preset
    from jaxpi.convert import CheckpointError, load_hf, save_hf
    from jaxpi.models import Qwen3_5ForCausalLM, Qwen3ForCausalLM

_WHERE = {
    "QWEN3_5_9B": "jaxpi.config",
    "QWEN3_5_27B": "jaxpi.config",
    "TINY": "jaxpi.config",
    "QWEN3_8B": "jaxpi.config",
    "QWEN3_TINY": "jaxpi.config",
    "QwenConfig": "jaxpi.config",
    "preset": "jaxpi.config",
    "CheckpointError": "jaxpi.convert",
    "load_hf": "jaxpi.convert",
    "save_hf": "jaxpi.convert",
    "Qwen3_5ForCausalLM": "jaxpi.models",
    "Qwen3ForCausalLM": "jaxpi.models",
}

__all__ = [
    "QWEN3_5_9B",
    "QWEN3_5_27B",
    "QWEN3_8B",
    "QWEN3_TINY",
    "TINY",
    "CheckpointError",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "QwenConfig",
    "load_hf",
    "preset",
    "save_hf",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxpi' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
