"""Adapter slots: where a LoRA adapter sits on a linear module and how the forward pass finds it.

A module holding stored projections (`MLP`, `GatedAttention`, `GatedDeltaNet`) may carry, for an
HF module `hf` whose stored parts are `projs` (one part, but three for `in_proj_qkv`):

    lora_a_<hf>       A     [(G,) *in, r]    one per HF module: the parts share it
    lora_b_<proj>     B     [(G,) r, *out]   one per stored projection
    lora_mask_<hf>    mask  [G]              1.0 / 0.0 per group; only on a stacked adapter whose
                                             layers are partly selected
    lora_scale        s = alpha / r          static (a float in the graphdef), one per module
    lora_dropout      the adapter's dropout rate, static
    lora_merged       True while W holds W + s·A·B (`merge_lora(keep_adapters=True)`), static

`G` is the scan over layer groups (absent in the unrolled tail). The slot names are the adapters'
NNX state paths (`groups/blocks/0/mixer/lora_a_q_proj`), which orbax checkpoints, the peft import
and export and the trainer's checkpoints read: they are spelled here and nowhere else. `jaxpi.lora`
fills the slots (`attach`, `detach`, `set_merged`); the model reads them with `adapter_for`.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

A_PREFIX = "lora_a_"
B_PREFIX = "lora_b_"
MASK_PREFIX = "lora_mask_"
SCALE = "lora_scale"
DROPOUT = "lora_dropout"
MERGED = "lora_merged"


def a_name(hf: str) -> str:
    """The slot of HF module `hf`'s A."""
    return A_PREFIX + hf


def b_name(proj: str) -> str:
    """The slot of stored projection `proj`'s B."""
    return B_PREFIX + proj


def mask_name(hf: str) -> str:
    """The slot of HF module `hf`'s per-group mask."""
    return MASK_PREFIX + hf


def parse_slot(name: str) -> tuple[str, str] | None:
    """`("a", hf)`, `("b", proj)` or `("mask", hf)` for an adapter slot's name; None for any other."""
    for kind, prefix in (("a", A_PREFIX), ("b", B_PREFIX), ("mask", MASK_PREFIX)):
        if name.startswith(prefix):
            return kind, name[len(prefix) :]
    return None


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The adapter of one stored projection, as the forward pass reads it.

    `a` `[(G,) *in, r]` (shared by the parts of one HF module), `b` `[(G,) r, *out]`, `mask` the
    per-group 1.0 / 0.0 (or None: every group selected); `scale` s, `dropout` the rate, `merged`
    True while the base weight already holds s·A·B (the update is then skipped). `a_axes` and
    `b_axes` are the factors' logical axes, one per dimension of `a` and `b` as read (inside the
    layer scan a stacked factor is one group's slice, without its `layers` axis); None where the
    factor was declared without any.
    """

    a: jax.Array
    b: jax.Array
    mask: jax.Array | None
    scale: float
    dropout: float
    merged: bool
    a_axes: tuple[str | None, ...] | None = None
    b_axes: tuple[str | None, ...] | None = None


def _value_axes(var: nnx.Variable, value: jax.Array) -> tuple[str | None, ...] | None:
    """The logical axes of `value`, `var`'s array: the trailing `value.ndim` of those declared
    (the stacked `layers` axis leads, and a scan step reads one group's slice)."""
    axes = var.get_metadata().get("out_sharding")
    if axes is None or len(axes) < value.ndim:
        return None
    return tuple(axes)[len(axes) - value.ndim :]


def adapter_for(module: nnx.Module, proj: str, hf: str | None = None) -> Adapter | None:
    """The adapter of `module`'s projection `proj` (whose A is HF module `hf`'s, default `proj`),
    or None when it has none."""
    b = getattr(module, b_name(proj), None)
    if b is None:
        return None
    name = hf or proj
    mask = getattr(module, mask_name(name), None)
    a = getattr(module, a_name(name))
    a_value, b_value = a[...], b[...]
    return Adapter(
        a=a_value,
        b=b_value,
        mask=None if mask is None else mask[...],
        scale=getattr(module, SCALE),
        dropout=getattr(module, DROPOUT, 0.0),
        merged=getattr(module, MERGED, False),
        a_axes=_value_axes(a, a_value),
        b_axes=_value_axes(b, b_value),
    )


def has_adapters(module: nnx.Module) -> bool:
    """Whether `module` carries adapters (`attach` was called on it)."""
    return hasattr(module, SCALE)


def is_merged(module: nnx.Module) -> bool:
    """Whether `module`'s adapters are folded into its base weights (and off in the forward pass)."""
    return getattr(module, MERGED, False)


def adapter_scale(module: nnx.Module) -> float:
    """s = alpha / r of `module`'s adapters."""
    return getattr(module, SCALE)


def attach(
    module: nnx.Module,
    hf: str,
    a: nnx.Variable,
    bs: dict[str, nnx.Variable],
    mask: nnx.Variable | None,
    *,
    scale: float,
    dropout: float,
) -> None:
    """Put HF module `hf`'s adapter in `module`'s slots: A, one B per stored part (`bs`, keyed by
    projection), the per-group mask if any, and the module's scale and dropout rate."""
    if mask is not None:
        setattr(module, mask_name(hf), mask)
    setattr(module, a_name(hf), a)
    for proj, b in bs.items():
        setattr(module, b_name(proj), b)
    setattr(module, SCALE, scale)
    setattr(module, DROPOUT, dropout)


def set_merged(module: nnx.Module, merged: bool) -> None:
    """Mark `module`'s adapters as folded into the base weights (True) or live (False)."""
    if merged:
        setattr(module, MERGED, True)
    elif hasattr(module, MERGED):
        delattr(module, MERGED)


def detach(module: nnx.Module) -> None:
    """Empty every adapter slot of `module` (weights, masks, scale, dropout, merged flag)."""
    for name in [n for n in vars(module) if parse_slot(n) is not None]:
        delattr(module, name)
    for name in (SCALE, DROPOUT, MERGED):
        if hasattr(module, name):
            delattr(module, name)
