"""A tiny bf16 Qwen3.5 checkpoint that vLLM's CPU backend runs (tests, docs' measurements).

The jaxpi tiny config with the two changes vLLM's CPU kernels need: Gated DeltaNet key/value head
dims of 64 (its kernel has 64 and 128 only) and bfloat16 weights (it refuses fp32 there). The
bundled tiny tokenizer comes along, so the server enables its chat parsers and the agent loop can
render prompts.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxpi.atomic import atomic_dir
from jaxpi.config import TINY, QwenConfig
from jaxpi.convert.tiny import make_checkpoint

VLLM_TINY: QwenConfig = TINY.replace(linear_key_head_dim=64, linear_value_head_dim=64)


def make_vllm_checkpoint(
    out: str | os.PathLike, *, seed: int = 0, layers: int = 4, overwrite: bool = False
) -> Path:
    """Write the tiny vLLM-compatible checkpoint (bf16, tokenizer included) into `out` atomically;
    an `out` with a config.json is reused, any other non-empty `out` is a FileExistsError unless
    `overwrite`."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    with atomic_dir(out, overwrite=overwrite) as tmp:
        make_checkpoint(
            tmp, VLLM_TINY.replace(num_hidden_layers=layers), seed=seed, dtype="bfloat16", tokenizer=True
        )
    return out
