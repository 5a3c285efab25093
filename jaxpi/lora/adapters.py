"""Adapter weights on a model: `add_lora` fills the model's adapter slots (`jaxpi.models.adapters`)
with A random and B zero; `adapter_module` finds the module holding one HF layer's adapter.
Merging is in `jaxpi.lora.merge`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.config import FULL
from jaxpi.lora.config import IN_DIMS, TARGETS, LoraConfig, select_modules
from jaxpi.models.adapters import attach, has_adapters
from jaxpi.models.quantized import weight_shape_axes
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_location, layer_plan


class LoRAParam(nnx.Variable):
    """A trainable adapter weight (the base model's `nnx.Param`s stay frozen)."""


class LoRAMask(nnx.Variable):
    """Per-group 1.0 / 0.0 of a stacked adapter whose layers are only partly selected (not trained)."""


def _stacked(cls: type[nnx.Variable], value: jax.Array, axes: tuple, stacked: bool) -> nnx.Variable:
    if stacked:
        axes = ("layers", *axes)
    return cls(value, out_sharding=tuple(axes), eager_sharding=False)


def _weight(module: nnx.Module, proj: str) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """(shape, logical axes) of a projection's base weight, dense or quantized."""
    return weight_shape_axes(getattr(module, proj))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One adapter to create: A's and each B's shape, and which stacked rows are selected (None = all)."""

    hf: str
    a_shape: tuple[int, ...]
    b_shapes: tuple[tuple[int, ...], ...]
    fan_in: int
    rows: tuple[bool, ...] | None


@functools.partial(jax.jit, static_argnums=1)
def _init_adapters(key: jax.Array, plans: tuple[_Plan, ...]) -> list[tuple[jax.Array, list[jax.Array]]]:
    """Every (A, [B...]) in one program: A from one stream of uniforms (one random-bits op, so one
    small compile rather than one per shape), B zeros. Abstract under `nnx.eval_shape`."""
    sizes = [math.prod(p.a_shape) for p in plans]
    u = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
    out, start = [], 0
    for p, n in zip(plans, sizes, strict=True):
        # peft's default: kaiming-uniform(a=√5) for A, i.e. U(±1/√fan_in); zeros for B.
        a = u[start : start + n].reshape(p.a_shape) / math.sqrt(p.fan_in)
        start += n
        if p.rows is not None:  # unselected layers of a stacked adapter hold zeros
            a = a * jnp.asarray(p.rows, jnp.float32).reshape(-1, *([1] * (a.ndim - 1)))
        out.append((a, [jnp.zeros(s, jnp.float32) for s in p.b_shapes]))
    return out


def _plan_module(
    module: nnx.Module,
    owner: str,
    lcfg: LoraConfig,
    layers: list[int],
    chosen: set[tuple[int, str]],
    stacked: bool,
) -> list[_Plan]:
    """The adapters `module` gets: its HF modules selected in any of `layers` (one per group)."""
    lead = (len(layers),) if stacked else ()
    plans = []
    for hf in lcfg.targets:
        kind, projs = TARGETS[hf]
        if kind != owner:
            continue
        rows = tuple((i, hf) in chosen for i in layers)
        if not any(rows):
            continue
        shape = _weight(module, projs[0])[0][len(lead) :]
        n_in = IN_DIMS.get(projs[0], 1)
        a_shape = (*lead, *shape[:n_in], lcfg.rank)
        b_shapes = tuple((*lead, lcfg.rank, *_weight(module, proj)[0][len(lead) + n_in :]) for proj in projs)
        plans.append(_Plan(hf, a_shape, b_shapes, math.prod(shape[:n_in]), None if all(rows) else rows))
    return plans


def _attach(
    module: nnx.Module, plan: _Plan, a: jax.Array, bs: list[jax.Array], lcfg: LoraConfig, stacked: bool
) -> None:
    lead = 1 if stacked else 0
    projs = TARGETS[plan.hf][1]
    n_in = IN_DIMS.get(projs[0], 1)
    axes = _weight(module, projs[0])[1][lead:]
    mask = None
    if plan.rows is not None:
        rows = jnp.asarray(np.asarray(plan.rows, np.float32))  # [G]
        mask = LoRAMask(rows, out_sharding=("layers",), eager_sharding=False)
    a_var = _stacked(LoRAParam, a, (*axes[:n_in], "lora_rank"), stacked)
    b_vars = {}
    for proj, b in zip(projs, bs, strict=True):
        paxes = _weight(module, proj)[1][lead:]
        b_vars[proj] = _stacked(LoRAParam, b, ("lora_rank", *paxes[n_in:]), stacked)
    attach(module, plan.hf, a_var, b_vars, mask, scale=lcfg.scale, dropout=lcfg.dropout)


def add_lora(
    model: Qwen3_5ForCausalLM, lcfg: LoraConfig, *, key: jax.Array | None = None
) -> Qwen3_5ForCausalLM:
    """Attach fresh adapters (A random, B zero) to every selected projection, in place."""
    if hasattr(model, "lora_config"):
        raise ValueError("the model already has LoRA adapters (merge_lora them first)")
    key = jax.random.key(0) if key is None else key
    cfg = model.cfg
    chosen = set(select_modules(cfg, lcfg))
    p, g = layer_plan(cfg)
    # (block, the HF layers it computes, stacked?): a group position runs layers j, j+P, j+2P, ...
    blocks = (
        [(blk, [k * p + j for k in range(g)], True) for j, blk in enumerate(model.groups.blocks)] if g else []
    )
    blocks += [(blk, [p * g + j], False) for j, blk in enumerate(model.tail)]
    todo = []
    for blk, layers, stacked in blocks:
        owner = "attn" if blk.layer_type == FULL else "gdn"
        for module, kind in ((blk.mixer, owner), (blk.mlp, "mlp")):
            todo += [
                (module, plan, stacked) for plan in _plan_module(module, kind, lcfg, layers, chosen, stacked)
            ]
    arrays = _init_adapters(key, tuple(plan for _, plan, _ in todo))
    for (module, plan, stacked), (a, bs) in zip(todo, arrays, strict=True):
        _attach(module, plan, a, bs, lcfg, stacked)
    model.lora_config = lcfg
    return model


def adapter_module(model: Qwen3_5ForCausalLM, layer: int, hf: str) -> tuple[nnx.Module, int | None]:
    """The module holding HF layer `layer`'s adapter `hf`, and its row in the stacked arrays (or None)."""
    kind = TARGETS[hf][0]
    where, pos, g = layer_location(model.cfg, layer)
    blk = model.groups.blocks[pos] if where == "groups" else model.tail[pos]
    return (blk.mlp if kind == "mlp" else blk.mixer), (g if where == "groups" else None)


def adapted_modules(model: Qwen3_5ForCausalLM) -> list[nnx.Module]:
    """Every block module (mixer or MLP) carrying adapters, scanned groups first."""
    groups = list(model.groups.blocks) if model.groups is not None else []
    return [m for blk in [*groups, *model.tail] for m in (blk.mixer, blk.mlp) if has_adapters(m)]
