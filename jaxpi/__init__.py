"""jaxpi: Qwen3.5 in JAX/Flax NNX, fine-tuned into a coding agent for the Pi harness."""

from jaxpi.config import QWEN3_5_27B, TINY, QwenConfig, preset
from jaxpi.convert import CheckpointError, load_hf, save_hf
from jaxpi.models import Qwen3_5ForCausalLM

__all__ = [
    "QWEN3_5_27B",
    "TINY",
    "CheckpointError",
    "Qwen3_5ForCausalLM",
    "QwenConfig",
    "load_hf",
    "preset",
    "save_hf",
]
__version__ = "0.1.0"
