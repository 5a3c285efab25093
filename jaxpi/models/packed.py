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

Projections of one module that read the same input (a DeltaNet layer's q, k, v, z, b and a; an
attention layer's q, k and v; the MLP's gate and up: `JOINT`) share one joint twin instead,
`packed_joint`: their weights side by side as one `[K, N_1 + N_2 + ...]` weight, so the step makes
one native call and one stream where it made up to six (as serving engines merge qkv and
gate/up). Each column is summed in the same order as in its own twin: the same bits. The forward
asks for a joint product through `Joint` and hands each projection its columns (`project(...,
base=...)`), adapters added per projection as before.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jaxpi.kernels.cpu import rows
from jaxpi.kernels.dense import packed_product

PREFIX = "packed_"
LM_HEAD = "packed_lm_head"
JOINT_SLOT = "packed_joint"
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


# Projections read from one input, longest first: a module's joint twin is the first group whose
# projections it stores, all as bf16 Params contracting their first axis, with the same input size.
JOINT = (
    ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj"),  # Gated DeltaNet
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("gate_proj", "up_proj"),  # MLP
)


class PackedWeight(nnx.Variable):
    """A projection's bf16 weight as `rows.packed_bf16` reads it (inference only, never trained)."""


def name(proj: str) -> str:
    """The slot of projection `proj`'s twin."""
    return PREFIX + proj


def _pack(w: jnp.ndarray, n_in: int) -> PackedWeight:
    k = math.prod(w.shape[:n_in])
    return PackedWeight(rows.pack(w.reshape(k, -1)))


def _packable(node: nnx.Module, proj: str) -> bool:
    w = getattr(node, proj, None)
    return isinstance(w, nnx.Param) and w.dtype == jnp.bfloat16 and w.ndim > CONTRACTED[proj]


def joint_parts(node: nnx.Module) -> tuple[str, ...]:
    """The projections `node`'s joint twin holds, in column order (empty: none)."""
    for group in JOINT:
        stored = all(_packable(node, p) and CONTRACTED[p] == 1 for p in group)
        if stored and len({getattr(node, p).shape[0] for p in group}) == 1:
            return group
    return ()


def attach(model: nnx.Module) -> int:
    """Packs every bf16 projection weight of `model` (and its LM head) into its twin's slot, or
    its module's joint twin (`JOINT`), replacing any twin there; returns the bytes packed. The
    layers must be unstacked (a weight with a layer-group axis would be packed whole)."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        joint = joint_parts(node)
        if joint:
            ws = [getattr(node, p)[...] for p in joint]
            w = jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1)
            setattr(node, JOINT_SLOT, PackedWeight(rows.pack(w)))
            total += w.nbytes
        for proj in CONTRACTED:
            if proj not in joint and _packable(node, proj):
                w = getattr(node, proj)
                setattr(node, name(proj), _pack(w[...], CONTRACTED[proj]))
                total += w.nbytes
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed", None)
    w = head[...] if isinstance(head, nnx.Param) else (embed[...].T if isinstance(embed, nnx.Param) else None)
    if w is not None and w.dtype == jnp.bfloat16:
        setattr(model, LM_HEAD, PackedWeight(rows.pack(w)))
        total += w.nbytes
    return total


class Joint:
    """The base products of a module's joint twin for one input `x`, made once on first use
    (inference only; where the module has no joint twin, `x` has too many rows or is not bf16,
    `base` returns None and each projection makes its own product)."""

    def __init__(self, node: nnx.Module, x: jnp.ndarray, *, inference: bool):
        self.node, self.x = node, x
        self.parts = joint_parts(node) if inference and hasattr(node, JOINT_SLOT) else ()
        self._y: jnp.ndarray | None = None

    def base(self, proj: str) -> jnp.ndarray | None:
        """`x · W_proj` in x's dtype, `[*lead, *W_proj.shape[1:]]`, from the joint product."""
        if proj not in self.parts:
            return None
        shapes = [getattr(self.node, p).shape for p in self.parts]
        widths = [math.prod(s[1:]) for s in shapes]
        if self._y is None:
            twin = getattr(self.node, JOINT_SLOT)[...]
            k = shapes[0][0]
            self._y = packed_product("...d,dn->...n", self.x, twin, (k, sum(widths)))
            if self._y is None:
                self.parts = ()
                return None
        i = self.parts.index(proj)
        lo = sum(widths[:i])
        lead = self.x.shape[:-1]
        return self._y[..., lo : lo + widths[i]].reshape(*lead, *shapes[i][1:])
