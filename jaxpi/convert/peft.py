"""Moved to `jaxpi.lora.peft`; this module re-exports it for the callers not yet switched."""

from jaxpi.lora.peft import (
    CAUSAL_PREFIX,
    CONDITIONAL_PREFIX,
    CONFIG_NAME,
    PEFT_VERSION,
    WEIGHTS_NAME,
    abstract_lora_model,
    adapter_config,
    adapter_tensors,
    base_prefix,
    load_peft,
    peft_key,
    read_peft,
    save_merged,
    save_peft,
    target_modules,
)

__all__ = [
    "CAUSAL_PREFIX",
    "CONDITIONAL_PREFIX",
    "CONFIG_NAME",
    "PEFT_VERSION",
    "WEIGHTS_NAME",
    "abstract_lora_model",
    "adapter_config",
    "adapter_tensors",
    "base_prefix",
    "load_peft",
    "peft_key",
    "read_peft",
    "save_merged",
    "save_peft",
    "target_modules",
]
