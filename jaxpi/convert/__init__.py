"""HF checkpoint conversion (safetensors in and out)."""

from jaxpi.convert.hf import CheckpointError, load_hf, save_hf

__all__ = ["CheckpointError", "load_hf", "save_hf"]
