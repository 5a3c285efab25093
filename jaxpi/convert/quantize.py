"""A quantized frozen base (QLoRA): which weights are quantized, the model's structure for them, and
the way back to dense weights.

bitsandbytes, through transformers' `BitsAndBytesConfig`, quantizes every `nn.Linear` of the text
layers (attention q/k/v/o, the DeltaNet's in_proj_qkv/z/b/a and out_proj, the MLP) and leaves the
embedding, the LM head, norms, the DeltaNet's conv and decay parameters in the load dtype. jaxpi
quantizes the same tensors (`LINEAR_MODULES`), each whole as bitsandbytes sees it (the fused
`in_proj_qkv` once, then split into jaxpi's q, k, v parts), from its values as loaded in the base
dtype: transformers casts to the load dtype before quantizing, so a float32 checkpoint trained
in bf16 is quantized from its bf16 values on both sides.

    quantize_structure(model, kind)   every quantized projection's Param → a QuantizedWeight
    quant_targets(cfg, rules, kind)   (HF tensor, part, our path, layout) of each of them
    dequantized(model)                a model with dense Params again (the weights the adapter saw)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.config import QwenConfig
from jaxpi.convert.table import Rule, stack_index, text_rules
from jaxpi.models.families import model_class
from jaxpi.models.quantized import QuantizedWeight, QuantParam
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_plan
from jaxpi.quant import check_base_quant
from jaxpi.quant.stored import Layout, dequantize, layout_for

LINEAR_KINDS = ("linear", "linear_t", "split")


@dataclasses.dataclass(frozen=True)
class QuantTarget:
    """One stored projection of one layer that holds (part of) a quantized HF tensor."""

    rule: Rule
    part: int
    path: tuple  # our parameter path (model-relative), e.g. ("groups", "blocks", 0, "mixer", "q_proj")
    group: int | None  # the slice of the stacked arrays (None in the unrolled tail)
    layout: Layout


def _part_io(rule: Rule, part: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input shape, output shape) of one stored part: `linear_t` keeps its heads as inputs."""
    s = rule.part_shapes[part]
    return (s[:-1], s[-1:]) if rule.kind == "linear_t" else (s[:1], s[1:])


def is_quantized(rule: Rule) -> bool:
    """Whether bitsandbytes quantizes this HF tensor: a linear layer of the text layers (the LM
    head, the only other linear, stays dense)."""
    return rule.layer >= 0 and rule.kind in LINEAR_KINDS


def quant_targets(cfg: QwenConfig, rules: list[Rule], kind: str) -> list[QuantTarget]:
    """Every stored part of every quantized HF tensor, in the rules' order."""
    check_base_quant(kind)
    out = []
    for rule in rules:
        if not is_quantized(rule):
            continue
        total = rule.hf_shape[0]
        for part, path in enumerate(rule.ours):
            rows = rule.part_rows(part) or (0, total)
            in_shape, out_shape = _part_io(rule, part)
            try:
                layout = layout_for(kind, in_shape, out_shape, rows=rows, total_rows=total)
            except ValueError as e:
                raise ValueError(f"{rule.hf}: {e}") from None
            out.append(QuantTarget(rule, part, tuple(path), stack_index(cfg, rule), layout))
    return out


def _owner(model: nnx.Module, path: tuple) -> nnx.Module:
    node: Any = model
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def quantize_structure(
    model: Qwen3_5ForCausalLM, kind: str, *, fill: Callable[[tuple, np.dtype], Any] = jnp.zeros
) -> Qwen3_5ForCausalLM:
    """Replace every quantized projection's `Param` by a `QuantizedWeight` of `kind` whose arrays
    are `fill(shape, dtype)` (zeros; abstract under `nnx.eval_shape`), in place. Stacked weights
    get stacked arrays with the `layers` axis first."""
    if check_base_quant(kind) == "none":
        return model
    cfg = model.cfg
    _, groups = layer_plan(cfg)
    seen: set[tuple] = set()
    for t in quant_targets(cfg, text_rules(cfg, "model."), kind):
        if t.path in seen:  # a stacked weight: one module for all its groups
            continue
        seen.add(t.path)
        owner, name = _owner(model, t.path), t.path[-1]
        dense = getattr(owner, name)
        weight_axes = tuple(dense.get_metadata().get("out_sharding") or ())
        stacked = groups if t.group is not None else 0
        lead, per = (("layers",), weight_axes[1:]) if stacked else ((), weight_axes)
        axes = t.layout.axes(per)
        arrays = {
            n: QuantParam(
                fill(((stacked,) if stacked else ()) + shape, dtype),
                out_sharding=(*lead, *axes[n]),
                eager_sharding=False,
            )
            for n, (shape, dtype) in t.layout.arrays().items()
        }
        setattr(owner, name, QuantizedWeight(t.layout, arrays, axes=weight_axes, stacked=stacked))
    return model


def abstract_model(cfg: QwenConfig, dtype: Any, base_quant: str = "none") -> Qwen3_5ForCausalLM:
    """The model of `cfg` with abstract arrays (`nnx.eval_shape`), its base quantized as `base_quant`."""
    dtype = jnp.dtype(dtype)
    return nnx.eval_shape(
        lambda: quantize_structure(model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(0)), base_quant)
    )


def quantized_weights(model: nnx.Module) -> list[tuple[tuple, QuantizedWeight]]:
    """(path, module) of every quantized weight of a model."""
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, QuantizedWeight)]


def dequantized(model: Qwen3_5ForCausalLM, dtype: Any = jnp.float32) -> Qwen3_5ForCausalLM:
    """Replace every `QuantizedWeight` by a dense `Param` holding its dequantized weight in `dtype`
    (float32: exactly bitsandbytes' float32 dequantization), in place; returns the model."""
    dtype = jnp.dtype(dtype)
    fn = jax.jit(lambda arrays, layout: dequantize(arrays, layout, dtype), static_argnums=1)
    for path, w in quantized_weights(model):
        arrays = w.arrays()
        if w.stacked:
            layers = [{k: a[g] for k, a in arrays.items()} for g in range(w.stacked)]
            dense = jnp.stack([fn(one, w.layout) for one in layers])
        else:
            dense = fn(arrays, w.layout)
        setattr(_owner(model, path), path[-1], nnx.Param(dense, out_sharding=w.axes, eager_sharding=False))
    return model


def quantized_bytes(model: nnx.Module) -> tuple[int, int]:
    """(bytes of the stored quantized arrays, parameters they hold)."""
    stored = params = 0
    for _, w in quantized_weights(model):
        for n in w.names:
            v = getattr(w, n).get_value()
            stored += math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
        params += math.prod(w.shape)
    return stored, params
