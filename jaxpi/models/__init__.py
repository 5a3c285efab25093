"""Flax NNX models."""

from jaxpi.models.families import MODELS, model_class
from jaxpi.models.qwen3 import Qwen3ForCausalLM
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_location, layer_plan

__all__ = ["MODELS", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "layer_location", "layer_plan", "model_class"]
