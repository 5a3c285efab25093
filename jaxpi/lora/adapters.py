"""Adapter weights on a model: `add_lora` attaches them (A random, B zero), `merge_lora` /
`unmerge_lora` fold them into the base weights and back (the equations are in `jaxpi.lora`)."""

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
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_location, layer_plan


class LoRAParam(nnx.Variable):
    """A trainable adapter weight (the base model's `nnx.Param`s stay frozen)."""


class LoRAMask(nnx.Variable):
    """Per-group 1.0 / 0.0 of a stacked adapter whose layers are only partly selected (not trained)."""


def a_name(hf: str) -> str:
    return f"lora_a_{hf}"


def b_name(proj: str) -> str:
    return f"lora_b_{proj}"


def mask_name(hf: str) -> str:
    return f"lora_mask_{hf}"


def _stacked(cls: type[nnx.Variable], value: jax.Array, axes: tuple, stacked: bool) -> nnx.Variable:
    if stacked:
        axes = ("layers", *axes)
    return cls(value, out_sharding=tuple(axes), eager_sharding=False)


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
        shape = getattr(module, projs[0]).get_value().shape[len(lead) :]
        n_in = IN_DIMS.get(projs[0], 1)
        a_shape = (*lead, *shape[:n_in], lcfg.rank)
        b_shapes = tuple(
            (*lead, lcfg.rank, *getattr(module, proj).get_value().shape[len(lead) + n_in :]) for proj in projs
        )
        plans.append(_Plan(hf, a_shape, b_shapes, math.prod(shape[:n_in]), None if all(rows) else rows))
    return plans


def _attach(
    module: nnx.Module, plan: _Plan, a: jax.Array, bs: list[jax.Array], lcfg: LoraConfig, stacked: bool
) -> None:
    lead = 1 if stacked else 0
    projs = TARGETS[plan.hf][1]
    n_in = IN_DIMS.get(projs[0], 1)
    axes = getattr(module, projs[0]).get_metadata()["out_sharding"][lead:]
    if plan.rows is not None:
        mask = jnp.asarray(np.asarray(plan.rows, np.float32))  # [G]
        setattr(module, mask_name(plan.hf), LoRAMask(mask, out_sharding=("layers",), eager_sharding=False))
    setattr(module, a_name(plan.hf), _stacked(LoRAParam, a, (*axes[:n_in], "lora_rank"), stacked))
    for proj, b in zip(projs, bs, strict=True):
        paxes = getattr(module, proj).get_metadata()["out_sharding"][lead:]
        setattr(module, b_name(proj), _stacked(LoRAParam, b, ("lora_rank", *paxes[n_in:]), stacked))
    module.lora_scale = lcfg.scale
    module.lora_dropout = lcfg.dropout


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


def _delta(module: nnx.Module, hf: str, proj: str, lead: int) -> jax.Array:
    """s·A·B for one stored projection, in W's shape (float32; unselected groups zero)."""
    a = getattr(module, a_name(hf)).get_value()
    b = getattr(module, b_name(proj)).get_value()
    a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [(G,) in, r]
    b2 = b.reshape(*b.shape[: lead + 1], -1)  # [(G,) r, out]
    w_shape = getattr(module, proj).get_value().shape
    delta = (module.lora_scale * jnp.matmul(a2, b2)).reshape(w_shape)
    mask = getattr(module, mask_name(hf), None)
    if mask is not None:
        delta = delta * mask.get_value().reshape(-1, *([1] * (delta.ndim - 1)))
    return delta


def _apply(model: Qwen3_5ForCausalLM, sign: float) -> None:
    for module, lead in _adapted_modules(model):
        for hf, (_, projs) in TARGETS.items():
            if getattr(module, a_name(hf), None) is None:
                continue
            for proj in projs:
                base = getattr(module, proj)
                w = base.get_value()
                base.set_value(
                    (w.astype(jnp.float32) + sign * _delta(module, hf, proj, lead)).astype(w.dtype)
                )


def merge_lora(model: Qwen3_5ForCausalLM, *, keep_adapters: bool = False) -> Qwen3_5ForCausalLM:
    """Fold every adapter into its base weight (W ← W + s·A·B, in W's dtype), in place.

    By default the adapters are then dropped. With `keep_adapters=True` they stay, switched off
    in the forward pass, so that `unmerge_lora` can subtract them back out (as peft's
    `merge_adapter` / `unmerge_adapter`).
    """
    if any(getattr(m, "lora_merged", False) for m, _ in _adapted_modules(model)):
        raise ValueError("the adapters are already merged (unmerge_lora first)")
    _apply(model, 1.0)
    for module, _ in _adapted_modules(model):
        if keep_adapters:
            module.lora_merged = True
            continue
        for hf, (_, projs) in TARGETS.items():
            if getattr(module, a_name(hf), None) is None:
                continue
            for proj in projs:
                delattr(module, b_name(proj))
            delattr(module, a_name(hf))
            if getattr(module, mask_name(hf), None) is not None:
                delattr(module, mask_name(hf))
        del module.lora_scale, module.lora_dropout
    if not keep_adapters and hasattr(model, "lora_config"):
        del model.lora_config
    return model


def unmerge_lora(model: Qwen3_5ForCausalLM) -> Qwen3_5ForCausalLM:
    """Undo `merge_lora(keep_adapters=True)`: W ← W − s·A·B and the adapters are live again.

    Exact up to one rounding of W's dtype (float32: ~1e-7 relative; bf16 loses the low bits).
    """
    modules = _adapted_modules(model)
    if not modules or not all(getattr(m, "lora_merged", False) for m, _ in modules):
        raise ValueError("no merged adapters to unmerge (merge_lora(model, keep_adapters=True) first)")
    _apply(model, -1.0)
    for module, _ in modules:
        del module.lora_merged
    return model


def _adapted_modules(model: Qwen3_5ForCausalLM) -> list[tuple[nnx.Module, int]]:
    """(module, number of stacking axes) for every block module carrying adapters."""
    groups = list(model.groups.blocks) if model.groups is not None else []
    out = []
    for blocks, lead in ((groups, 1), (list(model.tail), 0)):
        for blk in blocks:
            out += [(m, lead) for m in (blk.mixer, blk.mlp) if hasattr(m, "lora_scale")]
    return out
