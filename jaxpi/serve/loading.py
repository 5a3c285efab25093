"""Weights and tokenizer for `jaxpi serve`: a HF checkpoint, a jaxpi run, and optional adapters.

HF dir                     config.json + safetensors (+ tokenizer files)
jaxpi run / checkpoint     meta names the base and tokenizer; the orbax adapter goes on top
--adapter orbax            same as above, on the given base
--adapter PEFT dir         adapter_config.json + adapter_model.safetensors (`jaxpi export`'s form)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.convert.hf import load_hf
from jaxpi.data.render import load_tokenizer
from jaxpi.lora import add_lora
from jaxpi.lora.peft import load_peft
from jaxpi.serve.config import ServeConfig
from jaxpi.train.checkpoint import load_adapter


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A ready model (adapters attached), its tokenizer directory, and where they came from."""

    model: Any  # Qwen3_5ForCausalLM
    tokenizer_dir: Path
    base_dir: Path
    adapters: tuple[str, ...]


def _is_jaxpi_checkpoint(path: Path) -> bool:
    return (path / "checkpoints").is_dir() or ((path / "meta").is_dir() and (path / "adapter").is_dir())


def _is_peft(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def load_served_model(cfg: ServeConfig) -> Loaded:
    """Load `cfg.model` (+ `cfg.adapter`) as one model; errors name the directory at fault."""
    path = Path(cfg.model)
    if not path.exists():
        raise FileNotFoundError(f"--model {path} does not exist")
    adapters: list[tuple[str, Path]] = []
    if _is_jaxpi_checkpoint(path):
        adapters.append(("orbax", path))
    elif not (path / "config.json").is_file():
        raise ValueError(f"--model {path}: neither a HF checkpoint (config.json) nor a jaxpi run/checkpoint")
    if cfg.adapter:
        a = Path(cfg.adapter)
        if not a.exists():
            raise FileNotFoundError(f"--adapter {a} does not exist")
        if _is_peft(a):
            adapters.append(("peft", a))
        elif _is_jaxpi_checkpoint(a):
            adapters.append(("orbax", a))
        else:
            raise ValueError(
                f"--adapter {a}: neither a PEFT adapter (adapter_config.json) nor a jaxpi checkpoint"
            )
    orbax = [p for kind, p in adapters if kind == "orbax"]
    if len(orbax) > 1:
        raise ValueError("--model is a jaxpi checkpoint already; give --adapter only with a HF base")

    base_dir, tok_dir, state, lora_cfg = path, path, None, None
    if orbax:
        state, lora_cfg, meta = load_adapter(orbax[0])
        if orbax[0] != path:  # --adapter on an explicit base: the base is --model
            tok_dir = path
        else:
            base_dir = Path(meta["base"])
            tok_dir = Path(meta.get("tokenizer") or base_dir)
    if cfg.tokenizer:
        tok_dir = Path(cfg.tokenizer)
    check_tokenizer(tok_dir, given=bool(cfg.tokenizer))  # before the weights: a bad one fails fast
    _, model = load_hf(base_dir, jnp.dtype(cfg.dtype))
    if state is not None:
        # The adapter's structure comes from add_lora with the checkpoint's LoRA config; the saved
        # values then replace the fresh ones (B = 0 there, so nothing random survives).
        add_lora(model, lora_cfg, key=jax.random.key(0))
        nnx.update(model, state)
    for kind, p in adapters:
        if kind == "peft":
            if state is not None:
                raise ValueError("a PEFT --adapter goes on a HF base, not on a jaxpi checkpoint")
            load_peft(model, p)
    return Loaded(model, tok_dir, base_dir, tuple(str(p) for _, p in adapters))


def check_tokenizer(tok_dir: Path, *, given: bool) -> None:
    """The tokenizer serving renders chats with (loaded once: `load_tokenizer` caches it); one
    without a chat template is a ValueError that says how to give another (`--tokenizer`)."""
    try:
        load_tokenizer(str(tok_dir))
    except (OSError, ValueError) as e:
        if given:
            raise ValueError(f"--tokenizer {tok_dir}: {e}") from None
        raise ValueError(
            f"{e}; give --tokenizer DIR, a tokenizer directory with a chat template "
            "(the base model's, or jaxpi/assets/tiny_tokenizer for a tiny checkpoint)"
        ) from None
