"""The policy a GRPO run trains: a frozen base with LoRA adapters, and the two jitted programs
over it (one update on the GRPO loss, the log-probabilities of sampled sequences).

The base and the adapters come from `model.adapter` (a jaxpi SFT checkpoint, which names its
base, LoRA shape and tokenizer; or a peft adapter directory, applied to `model.base`), else fresh
adapters (`lora`) on `model.base`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpi.config import QwenConfig
from jaxpi.convert.hf import load_hf
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.lora.peft import load_peft
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.loss import make_grpo_loss_fn, sequence_logprobs, trajectory_weights
from jaxpi.train.base import prepare_base
from jaxpi.train.checkpoint import load_adapter
from jaxpi.train.schedule import make_optimizer
from jaxpi.train.step import make_train_step, split_trainable


@dataclasses.dataclass
class Policy:
    """The trainable adapters, the frozen rest, and what a run needs around them."""

    graphdef: Any
    train: Any  # nnx.State of LoRAParam
    rest: Any  # frozen base weights (shared with the engine, never copied)
    lora: LoraConfig
    base_dir: Path
    tokenizer_dir: Path
    model_cfg: QwenConfig


def load_policy(cfg: GRPOConfig, run_dir: Path, key: Any) -> Policy:
    """Base + adapters: from `model.adapter` (an SFT checkpoint) or fresh ones on `model.base`."""
    adapter = None
    base_options = {"max_value": cfg.env.max_value}  # the toy bases' values (jaxpi.bases entry points)
    if cfg.model.adapter and (Path(cfg.model.adapter) / "adapter_config.json").exists():
        # A peft adapter (e.g. trained with peft/TRL) on `model.base`: its own rank and targets.
        base_dir = prepare_base(cfg.model, run_dir, seed=cfg.train.seed, options=base_options)
        lora_cfg, adapter = load_peft(QwenConfig.from_hf(base_dir), cfg.model.adapter)
        tokenizer_dir = base_dir
    elif cfg.model.adapter:
        adapter, lora_cfg, meta = load_adapter(cfg.model.adapter)
        base_dir = Path(meta["base"])
        tokenizer_dir = Path(meta.get("tokenizer") or base_dir)
    else:
        base_dir = prepare_base(cfg.model, run_dir, seed=cfg.train.seed, options=base_options)
        lora_cfg, tokenizer_dir = cfg.lora, base_dir
    model_cfg, model = load_hf(base_dir, jnp.dtype(cfg.model.dtype), config_overrides=cfg.model.overrides())
    add_lora(model, lora_cfg, key=key)
    if adapter is not None:
        nnx.update(model, adapter)
    graphdef, params = nnx.split(model)
    train, rest = split_trainable(params, LoRAParam)
    return Policy(graphdef, train, rest, lora_cfg, base_dir, tokenizer_dir, model_cfg)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The run's jitted programs over `Policy.graphdef`."""

    optimizer: optax.GradientTransformation
    # (train, rest, opt_state, batch) -> (train, opt_state, metrics); opt_state is donated
    update: Callable[..., tuple[Any, Any, Any]]
    logp: Callable[[Any, Any, jax.Array], jax.Array]  # (train, rest, ids [B, T]) -> [B, T]


def make_programs(cfg: GRPOConfig, graphdef: Any) -> Programs:
    """The optimizer, one GRPO update (`train.grad_accum` microbatches) and sequence log-probs."""
    optimizer = make_optimizer(cfg.optim, cfg.train.collections)
    step_fn = make_train_step(
        graphdef,
        optimizer,
        loss_fn=make_grpo_loss_fn(cfg.loss),
        trainable=LoRAParam,
        accum_steps=cfg.train.grad_accum,
        weight_fn=trajectory_weights,
    )

    def update(train: Any, rest: Any, opt_state: Any, batch: dict[str, Any]) -> tuple[Any, Any, Any]:
        # Only the adapters and their optimizer state come back: the frozen weights stay the very
        # arrays the engine reads (no copy of the base per update).
        params, opt_state, metrics = step_fn(nnx.merge_state(train, rest), opt_state, batch)
        return split_trainable(params, LoRAParam)[0], opt_state, metrics

    logp = jax.jit(lambda train, rest, ids: sequence_logprobs(nnx.merge(graphdef, train, rest), ids))
    return Programs(optimizer, jax.jit(update, donate_argnums=(2,)), logp)
