"""Merging adapters into the base weights, as pure functions over state trees.

For every stored projection W that has an adapter (A of its HF module, its own B, and the
module's mask if the adapter is stacked over partly selected groups):

    merged_params:    W' = round_W(W + s · mask ⊙ (A·B))     in float32, rounded once to W's dtype
    unmerged_params:  W' = round_W(W − s · mask ⊙ (A·B))

`params` is a model's `nnx.Param` state and `lora` its adapter state (`nnx.state(model, ADAPTER)`:
the `LoRAParam`s and the `LoRAMask`s), matched by path (`.../mixer/q_proj` with
`.../mixer/lora_a_q_proj`, `.../mixer/lora_b_q_proj`). Both are read, never written; the result is
a new `nnx.Param` state in which only the adapted weights are new arrays. `merge_lora` and
`unmerge_lora` are the in-place wrappers (split the model, apply the pure function, `nnx.update`
the result back) that also switch the adapters off and on.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.lora.adapters import LoRAMask, LoRAParam, adapted_modules
from jaxpi.lora.config import IN_DIMS, TARGETS, LoraConfig
from jaxpi.models.adapters import adapter_scale, b_name, detach, is_merged, mask_name, parse_slot, set_merged
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

# The adapter state `merged_params` reads: weights and masks.
ADAPTER = (LoRAParam, LoRAMask)

StatePath = tuple[Any, ...]


def _value(leaf: Any) -> jax.Array:
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def lora_deltas(
    lora: nnx.State, scale: float | LoraConfig, shapes: dict[StatePath, tuple[int, ...]]
) -> dict[StatePath, jax.Array]:
    """`{path of W: s·mask ⊙ (A·B)}` (float32, W's shape) for every stored projection with an
    adapter in `lora`; `shapes` gives each W's shape by path."""
    s = scale.scale if isinstance(scale, LoraConfig) else scale
    flat = {tuple(p): _value(v) for p, v in nnx.to_flat_state(lora)}
    out = {}
    for path, a in flat.items():
        slot = parse_slot(str(path[-1]))
        if slot is None or slot[0] != "a":
            continue
        module, hf = path[:-1], slot[1]
        projs = TARGETS[hf][1]
        lead = a.ndim - IN_DIMS.get(projs[0], 1) - 1  # 1 in a scanned group (A [G, *in, r]), else 0
        mask = flat.get((*module, mask_name(hf)))
        a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [(G,) in, r]
        for proj in projs:
            b = flat[(*module, b_name(proj))]
            b2 = b.reshape(*b.shape[: lead + 1], -1)  # [(G,) r, out]
            delta = (s * jnp.matmul(a2, b2)).reshape(shapes[(*module, proj)])
            if mask is not None:  # unselected groups of a stacked adapter
                delta = delta * mask.reshape(-1, *([1] * (delta.ndim - 1)))
            out[(*module, proj)] = delta
    return out


def _fold(params: nnx.State, lora: nnx.State, scale: float | LoraConfig, sign: float) -> nnx.State:
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(params)]
    deltas = lora_deltas(lora, scale, {p: _value(v).shape for p, v in flat})
    out = []
    for path, var in flat:
        if path in deltas:
            w = _value(var)
            new = (w.astype(jnp.float32) + sign * deltas[path]).astype(w.dtype)
            var = var.replace(new) if isinstance(var, nnx.Variable) else new
        out.append((path, var))
    return nnx.from_flat_state(out)


def merged_params(params: nnx.State, lora: nnx.State, scale: float | LoraConfig) -> nnx.State:
    """`params` with every adapter folded in: W ← W + s·A·B, in W's dtype (a new state)."""
    return _fold(params, lora, scale, 1.0)


def unmerged_params(params: nnx.State, lora: nnx.State, scale: float | LoraConfig) -> nnx.State:
    """The inverse of `merged_params`: W ← W − s·A·B, in W's dtype (a new state). Exact up to one
    rounding of W's dtype (float32: ~1e-7 relative; bf16 loses the low bits)."""
    return _fold(params, lora, scale, -1.0)


def model_scale(model: Qwen3_5ForCausalLM) -> float:
    """The adapters' s = alpha / r (one for the whole model; 1.0 when it has no adapters)."""
    scales = {adapter_scale(m) for m in adapted_modules(model)}
    if len(scales) > 1:
        raise ValueError(f"the model's adapters have different scales {sorted(scales)}")
    return scales.pop() if scales else 1.0


def merged_state(model: Qwen3_5ForCausalLM) -> nnx.State:
    """The model's `nnx.Param` state with its adapters folded in; the model is left as it is."""
    if any(is_merged(m) for m in adapted_modules(model)):
        raise ValueError("the adapters are already merged (unmerge_lora first)")
    return merged_params(nnx.state(model, nnx.Param), nnx.state(model, ADAPTER), model_scale(model))


def merge_lora(model: Qwen3_5ForCausalLM, *, keep_adapters: bool = False) -> Qwen3_5ForCausalLM:
    """Fold every adapter into its base weight (W ← W + s·A·B, in W's dtype), in place.

    By default the adapters are then dropped. With `keep_adapters=True` they stay, switched off
    in the forward pass, so that `unmerge_lora` can subtract them back out (as peft's
    `merge_adapter` / `unmerge_adapter`).
    """
    nnx.update(model, merged_state(model))
    for module in adapted_modules(model):
        if keep_adapters:
            set_merged(module, True)
        else:
            detach(module)
    if not keep_adapters and hasattr(model, "lora_config"):
        del model.lora_config
    return model


def unmerge_lora(model: Qwen3_5ForCausalLM) -> Qwen3_5ForCausalLM:
    """Undo `merge_lora(keep_adapters=True)`: W ← W − s·A·B and the adapters are live again.

    Exact up to one rounding of W's dtype (float32: ~1e-7 relative; bf16 loses the low bits).
    """
    modules = adapted_modules(model)
    if not modules or not all(is_merged(m) for m in modules):
        raise ValueError("no merged adapters to unmerge (merge_lora(model, keep_adapters=True) first)")
    params = unmerged_params(nnx.state(model, nnx.Param), nnx.state(model, ADAPTER), model_scale(model))
    nnx.update(model, params)
    for module in modules:
        set_merged(module, False)
    return model
