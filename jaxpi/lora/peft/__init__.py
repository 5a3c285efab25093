"""LoRA adapters out to (and back from) the `peft` format, and merged HF exports.

A `peft` LoRA adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`.
Its tensor names are the HF module paths under peft's wrapper, which differ by architecture:

    Qwen3_5ForCausalLM                base_model.model.model.layers.N.<block>.<module>.lora_A.weight
    Qwen3_5ForConditionalGeneration   base_model.model.model.language_model.layers.N.<block>.<module>...

(`<block>` is `self_attn`, `linear_attn` or `mlp`). vLLM silently ignores adapter tensors whose
names do not match its modules, so the prefix is taken from the base checkpoint's `config.json`.
Layouts are torch's: `lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`, with our multi-axis
inputs/outputs (heads × head_dim) flattened in HF's row-major order; the fused `in_proj_qkv` has
`lora_B = concat(B_q, B_k, B_v)` along `out`, HF's [q | k | v] channel order.

`save_peft` and `save_merged` write atomically (a temporary directory renamed into place).

Modules: `names` (file and tensor names), `export` (save_peft, save_merged), `load` (read_peft,
load_peft).
"""

from jaxpi.lora.peft.export import adapter_config, adapter_tensors, save_merged, save_peft, target_modules
from jaxpi.lora.peft.load import abstract_lora_model, load_peft, read_peft
from jaxpi.lora.peft.names import (
    CAUSAL_PREFIX,
    CONDITIONAL_PREFIX,
    CONFIG_NAME,
    PEFT_VERSION,
    WEIGHTS_NAME,
    base_prefix,
    peft_key,
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
