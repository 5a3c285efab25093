"""The Pallas kernels under a mesh: each kernel call runs inside `jax.shard_map`.

A Pallas call lowers to one custom call (Triton on GPU, Mosaic on TPU) that XLA's SPMD partitioner
cannot split: it gathers every operand whole onto each device, or refuses. When the model is traced
under a mesh (a resolver installed by `jaxpi.axes.activation_sharding`, as
`sharding.with_activation_constraints` does), the kernels instead run once per shard, inside
`jax.shard_map` over the resolver's mesh, manual over all of its axes. Each dimension's spec entry is
what the resolver splits its logical axis over, cut to the longest prefix of mesh axes that divides
the dimension (the rule of `sharding.spec_for`), except for the axes the kernel needs whole, which get
None:

    gated delta rule   q, k [B, T, Hk, Dk], v [B, T, Hv, Dv]   P(batch, None, heads, None)
                       g, β [B, T, Hv]                         P(batch, None, heads)
                       initial / final state [B, Hv, Dk, Dv]   P(batch, heads, None, None)
                       segment ids [B, T]                      P(batch, None)
                       output [B, T, Hv, Dv]                   P(batch, None, heads, None)
    norms              x, gate, y [..., D]                     P(<x's leading axes>, None)
                       weight [D]                              P()

The recurrence needs the sequence whole; a norm only its feature axis (rows are independent, so a
sequence split stays). A strategy that splits an axis a kernel needs whole (sequence parallel on
`seq`, a split `head_dim`) is not an error: the None in the spec makes shard_map gather that axis at
the kernel's boundary (XLA inserts the all-gather), the shards along it all compute the whole
sequence, and the model's next `constrain` splits the result again. Correct, at the price of that
gather and the repeated work; a sequence-parallel recurrence would pass states between shards.

GQA: value head h reads key head h // (Hv / Hk) (`gdn_chunked._prepare_qk`, transformers'
repeat_interleave). Splitting both head axes into the same n contiguous blocks keeps that pairing:
shard i holds value heads [i·Hv/n, (i+1)·Hv/n) and exactly the key heads they read,
[i·Hk/n, (i+1)·Hk/n). So q and k are split like v whenever n divides Hk; when it does not (fewer key
heads than head shards), q and k are repeated to the value heads before the shard_map and then split
exactly like v (the kernel repeats them anyway; the copy is made one step earlier).

Backward: autodiff goes through shard_map. The norm weight enters replicated, so its cotangent (dw,
a sum over rows) is summed over the shards by shard_map's transpose (a psum over the mesh axes the
weight's spec leaves out). Without a resolver (one device, the default) the kernels run untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpi.axes import ActivationResolver, current_resolver

# The head axes a per-head norm's input [B, T, H, D] carries in the model: attention q and k, the
# DeltaNet output. Without explicit axes a norm splits H over their mesh axes when all of them agree.
NORM_HEAD_AXES = ("q_heads", "kv_heads", "gdn_v_heads")

Entry = str | tuple[str, ...] | None
# rule(q, k, v, g, beta, initial_state, segment_ids) -> (output, final state)
Rule = Callable[..., tuple[jax.Array, jax.Array]]
# kernel(x, gate or None, weight) -> y
NormKernel = Callable[[jax.Array, jax.Array | None, jax.Array], jax.Array]


class MeshLayout:
    """The resolver's mesh and what it splits each logical axis over."""

    def __init__(self, resolver: ActivationResolver, mesh: Mesh | jax.sharding.AbstractMesh):
        self.resolver, self.mesh = resolver, mesh

    def mesh_axes(self, logical: str | None, size: int | None = None) -> tuple[str, ...]:
        """The mesh axes a dimension of `size` with this logical axis is split over (the table's
        own axes when size is None)."""
        if logical is None:
            return ()
        # Probed at a size every product of mesh axes divides: the strategy's axes, and no Fallback
        # recorded for a tensor that does not exist (the model's `constrain` records the real ones).
        sharding = self.resolver((logical,), (self.mesh.size,))
        entry = sharding.spec[0] if isinstance(sharding, NamedSharding) and len(sharding.spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        while size is not None and axes and size % self.shards(axes):
            axes = axes[:-1]  # the longest prefix that divides, as sharding.spec_for keeps
        return axes

    def spec(self, tensor: str, logical_axes: Sequence[str | None], shape: Sequence[int]) -> P:
        """The PartitionSpec of a kernel operand; a None logical axis stays whole. Two logical axes
        on one mesh axis are an error naming the operand (the model's `constrain` raises first)."""
        claimed: dict[str, str] = {}
        entries: list[Entry] = []
        for logical, size in zip(logical_axes, shape, strict=True):
            axes = self.mesh_axes(logical, size)
            for a in axes:
                if a in claimed:
                    raise ValueError(
                        f"{tensor}: logical axes {claimed[a]!r} and {logical!r} are both split over mesh axis {a!r}"
                    )
                claimed[a] = logical
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    def shards(self, entry: Entry) -> int:
        """How many pieces a PartitionSpec entry cuts its dimension into."""
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        return math.prod(self.mesh.shape[a] for a in axes)


def mesh_layout() -> MeshLayout | None:
    """The installed resolver's layout, or None when the kernels should run as they are: no
    resolver, a one-device mesh, or already inside a manual region (a caller's shard_map)."""
    resolver = current_resolver()
    if resolver is None:
        return None
    if any(t == AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types):
        return None
    probe = resolver((None,), (1,))
    if not isinstance(probe, NamedSharding) or probe.mesh.size == 1:
        return None
    return MeshLayout(resolver, probe.mesh)


def run_sharded(
    fn: Callable, layout: MeshLayout, in_specs: Sequence[P], out_specs: Any, *args: jax.Array
) -> Any:
    """`fn(*args)` once per shard: `jax.shard_map` over the layout's mesh, manual over all its axes.

    check_vma=False: a `pallas_call`'s outputs carry no varying-mesh-axes type (its out_shape is a
    plain ShapeDtypeStruct), which check_vma=True demands. Without the check, shard_map's transpose
    divides an output's cotangent over the mesh axes its spec leaves out and sums an input's
    cotangent over the axes its spec leaves out: the replicated norm weight's dw is summed over
    every shard, as it must be.
    """
    return jax.shard_map(
        fn, mesh=layout.mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
    )(*args)


def sharded_gated_delta_rule(
    rule: Rule,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
    segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """`rule(q, k, v, g, beta, initial_state, segment_ids)` per (batch, value head) shard under a
    mesh (the specs in the module docstring); as it is without one."""
    layout = mesh_layout()
    hk, hv = k.shape[2], v.shape[2]
    if layout is None or hv % hk:  # uneven GQA: the rule's own error, with the whole shapes
        return rule(q, k, v, g, beta, initial_state, segment_ids)
    # the sequence and head_dim whole: None (a split one is gathered at the boundary)
    tokens = layout.spec("gated delta rule v", ("batch", None, "gdn_v_heads", None), v.shape)
    b, h = tokens[0], tokens[2]
    if hk % layout.shards(h):
        # the key heads do not split into the value heads' blocks: give q/k the value heads
        q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q, k))  # [B, T, Hk, Dk] -> [B, T, Hv, Dk]
    gates, state = P(b, None, h), P(b, h, None, None)
    has_state, has_segments = initial_state is not None, segment_ids is not None
    optional = [x for x in (initial_state, segment_ids) if x is not None]
    optional_specs = [state] * has_state + [P(b, None)] * has_segments

    def local(q, k, v, g, beta, *rest):
        s0 = rest[0] if has_state else None
        seg = rest[-1] if has_segments else None
        return rule(q, k, v, g, beta, s0, seg)

    in_specs = [tokens] * 3 + [gates] * 2 + optional_specs
    return run_sharded(local, layout, in_specs, (tokens, state), q, k, v, g, beta, *optional)


def default_norm_axes(layout: MeshLayout, ndim: int) -> tuple[str | None, ...]:
    """Logical axes for a norm input of this rank: [B, T, D] the residual stream, [B, T, H, D] one
    of NORM_HEAD_AXES (split only when the strategy splits all of them alike); the last axis is
    the normalised one."""
    lead: list[str | None] = ["batch", "seq"][: max(ndim - 1, 0)]
    lead += [None] * (ndim - 1 - len(lead))
    if ndim == 4 and len({layout.mesh_axes(a) for a in NORM_HEAD_AXES}) == 1:
        lead[2] = NORM_HEAD_AXES[0]
    return (*lead, None)


def sharded_norm(
    kernel: NormKernel,
    x: jax.Array,
    gate: jax.Array | None,
    weight: jax.Array,
    axes: Sequence[str | None] | None = None,
) -> jax.Array:
    """`kernel(x, gate, weight)` per row shard under a mesh; as it is without one.

    `axes`: x's logical axes (None: `default_norm_axes`); the last one is kept whole whatever it is.
    """
    layout = mesh_layout()
    if layout is None:
        return kernel(x, gate, weight)
    axes = default_norm_axes(layout, x.ndim) if axes is None else tuple(axes)
    if len(axes) != x.ndim:
        raise ValueError(f"norm input of shape {x.shape} annotated with {len(axes)} axes {axes}")
    rows = layout.spec("norm input", (*axes[:-1], None), x.shape)  # the normalised axis whole
    if gate is None:
        return run_sharded(lambda x, w: kernel(x, None, w), layout, (rows, P()), rows, x, weight)
    return run_sharded(kernel, layout, (rows, rows, P()), rows, x, gate, weight)
