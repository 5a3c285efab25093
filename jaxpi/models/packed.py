"""Packed twins: a bf16 projection weight kept a second time, laid out for the CPU kernel of 1-256
rows on AVX-512 BF16 dot products (`jaxpi.kernels.cpu.rows.packed_bf16`), for inference.

The embedded engine attaches them to its own copy of the model (`attach`) where that kernel runs:
each stored projection `proj` of a module gets a slot `packed_<proj>` holding `rows.pack` of the
weight as the forward contracts it (`[K, N]`: o_proj and out_proj contract their first two axes,
the others their first), and the model a `packed_lm_head` (the LM head's `[hidden, vocab]`, the
embedding table's transpose when the two are tied). `jaxpi.models.layers.project` and the model's
LM head read a twin in inference only; training never sees one. The twins are packed once, when
attached, so a decode step reads each weight as one contiguous stream per strip of 32 columns
without packing it per call; `attach` again after the base weights change.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jaxpi.kernels.cpu import rows

PREFIX = "packed_"
LM_HEAD = "packed_lm_head"
# Stored projections the forward reads through `project`, and how many leading axes it contracts.
CONTRACTED = {
    "q_proj": 1,
    "k_proj": 1,
    "v_proj": 1,
    "o_proj": 2,
    "gate_proj": 1,
    "up_proj": 1,
    "down_proj": 1,
    "b_proj": 1,
    "a_proj": 1,
    "z_proj": 1,
    "out_proj": 2,
}


class PackedWeight(nnx.Variable):
    """A projection's bf16 weight as `rows.packed_bf16` reads it (inference only, never trained)."""


def name(proj: str) -> str:
    """The slot of projection `proj`'s twin."""
    return PREFIX + proj


def _pack(w: jnp.ndarray, n_in: int) -> PackedWeight:
    k = math.prod(w.shape[:n_in])
    return PackedWeight(rows.pack(w.reshape(k, -1)))


def attach(model: nnx.Module) -> int:
    """Packs every bf16 projection weight of `model` (and its LM head) into its twin's slot,
    replacing any twin there; returns the bytes packed. The layers must be unstacked (a weight
    with a layer-group axis would be packed whole)."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for proj, n_in in CONTRACTED.items():
            w = getattr(node, proj, None)
            if isinstance(w, nnx.Param) and w.dtype == jnp.bfloat16 and w.ndim > n_in:
                setattr(node, name(proj), _pack(w[...], n_in))
                total += w.nbytes
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed", None)
    w = head[...] if isinstance(head, nnx.Param) else (embed[...].T if isinstance(embed, nnx.Param) else None)
    if w is not None and w.dtype == jnp.bfloat16:
        setattr(model, LM_HEAD, PackedWeight(rows.pack(w)))
        total += w.nbytes
    return total
