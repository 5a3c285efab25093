"""peft's file and tensor names for a jaxpi LoRA adapter (see `jaxpi.lora.peft`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpi.convert.safetensors_io import CODES, CheckpointError
from jaxpi.lora.config import HF_BLOCK, TARGETS

PEFT_VERSION = "0.21.2"  # the peft release whose adapter_config.json fields we write
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CAUSAL_PREFIX = "model."
CONDITIONAL_PREFIX = "model.language_model."
KEY = re.compile(
    r"base_model\.model\.(model\.(?:language_model\.)?)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight"
)


def base_prefix(base_dir: str | os.PathLike) -> str:
    """The text model's module prefix in the base checkpoint: "model." (`Qwen3_5ForCausalLM`) or
    "model.language_model." (`Qwen3_5ForConditionalGeneration`), from its `config.json`."""
    raw = read_json(Path(base_dir) / "config.json")
    archs = raw.get("architectures") or []
    conditional = "text_config" in raw or any("ConditionalGeneration" in a for a in archs)
    return CONDITIONAL_PREFIX if conditional else CAUSAL_PREFIX


def peft_key(prefix: str, layer: int, hf: str, which: str) -> str:
    """`base_model.model.<prefix>layers.<layer>.<block>.<hf>.lora_<which>.weight`."""
    block = HF_BLOCK[TARGETS[hf][0]]
    return f"base_model.model.{prefix}layers.{layer}.{block}.{hf}.lora_{which}.weight"


def dtype_code(dtype: str) -> str:
    """The safetensors code of an adapter's stored dtype (float32, bfloat16 or float16)."""
    code = CODES.get(np.dtype(jnp.dtype(dtype)))
    if code not in ("F32", "BF16", "F16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', not {dtype!r}")
    return code


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file; a missing file or bad JSON is an error that names it."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
