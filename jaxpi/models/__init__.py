"""Flax NNX models."""

from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_location, layer_plan

__all__ = ["Qwen3_5ForCausalLM", "layer_location", "layer_plan"]
