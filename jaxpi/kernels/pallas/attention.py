"""Causal self-attention as a flash-attention kernel: JAX's Pallas GPU `mha` (Triton).

`pallas_causal_attention` has the contract of `jaxpi.kernels.attention.causal_attention` (q
[B, T, Hq, D], k, v [B, T, Hkv, D], optional segment ids [B, T]; token t sees u ≤ t of its own
segment) and computes it with `jax.experimental.pallas.ops.gpu.attention.mha`: the scores are
formed block by block in on-chip memory with an online softmax, so neither they nor their
gradient ([B, Hq, T, T] float32 in the plain path, half of it computed) are ever written out, and
the backward recomputes them per block (the kernel's `custom_vjp`). The kernel takes one kv head
per query head, so k and v are repeated to the query heads first (value head h of query head h
is kv head h // (Hq / Hkv), as `attention` groups them); their gradients sum back through the
repeat. T is padded to the block size at the end: causality alone keeps the padding out of
every real token's view.

Platforms, as the other kernels (`dispatch.per_platform`): on GPU the Triton kernel above; on TPU
JAX's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`, Mosaic;
[B, H, T, D] layout, T padded to its 128-blocks, segment ids as `SegmentIds`); on CPU the GPU
kernel in Pallas' interpreter (the tests' parity check; interpreted timings mean nothing).
`interpret="tpu"` runs the TPU kernel instead, which on CPU needs the caller to hold
`pltpu.force_tpu_interpret_mode()` around the forward and the backward (as the tests do). Under
a mesh the kernel runs per (batch, head) shard in `jax.shard_map`, the sequence whole (as for the
gated delta rule, `sharded`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.sharding import PartitionSpec as P

from jaxpi.kernels.pallas.dispatch import per_platform
from jaxpi.kernels.pallas.sharded import mesh_layout, run_sharded


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """`block_q` / `block_k`: the forward's query and key blocks; `block_backward`: the blocks of
    both backward passes (dK/dV and dQ); `num_warps` (None: the kernel's choice) and `num_stages`
    are Triton's. Blocks must be powers of two ≥ 16 (Triton's tile rule); T is padded to the
    largest. The TPU kernel takes its own default blocks (128). `interpret`: None = per platform,
    True = the GPU kernel in Pallas' interpreter everywhere, "tpu" = the TPU kernel (module docstring)."""

    block_q: int = 64
    block_k: int = 64
    block_backward: int = 32
    num_warps: int | None = None
    num_stages: int = 2
    interpret: bool | str | None = None

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k", "block_backward"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")
        if self.interpret not in (None, True, "tpu"):
            raise ValueError(f"interpret must be None, True or 'tpu', got {self.interpret!r}")

    def block_sizes(self) -> gpu_attention.BlockSizes:
        bb = self.block_backward
        return gpu_attention.BlockSizes(
            block_q=self.block_q,
            block_k=self.block_k,
            block_q_dkv=bb,
            block_kv_dkv=bb,
            block_q_dq=bb,
            block_kv_dq=bb,
        )


def _pad_tokens(multiple: int, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None):
    """q, k, v [B, T, H, D] and segments [B, T] padded at the end of T to a multiple of `multiple`:
    causality alone keeps the padding out of every real token's view (segments continue the last)."""
    pad = -q.shape[1] % multiple
    if not pad:
        return q, k, v, segments
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    if segments is not None:
        segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge")
    return q, k, v, segments


def _flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    opts: AttentionOptions,
    interpret: bool,
):
    """mha on [B, T, H, D] with as many kv as query heads, T padded to the blocks at the end."""
    t = q.shape[1]
    q, k, v, segments = _pad_tokens(max(opts.block_q, opts.block_k, opts.block_backward), q, k, v, segments)
    out = gpu_attention.mha(
        q,
        k,
        v,
        segments,
        sm_scale=q.shape[-1] ** -0.5,
        causal=True,
        block_sizes=opts.block_sizes(),
        num_warps=opts.num_warps,
        num_stages=opts.num_stages,
        interpret=interpret,
    )
    return out[:, :t]


# the TPU kernel's sequence blocks (its BlockSizes.get_default)
TPU_BLOCK = 128


def _tpu_flash(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
    """The Pallas TPU flash attention on [B, T, H, D] with as many kv as query heads."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    t = q.shape[1]
    q, k, v, segments = _pad_tokens(TPU_BLOCK, q, k, v, segments)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, T, H, D] <-> [B, H, T, D]
    ids = None if segments is None else tpu_attention.SegmentIds(q=segments, kv=segments)
    out = tpu_attention.flash_attention(
        *map(heads_first, (q, k, v)), segment_ids=ids, causal=True, sm_scale=q.shape[-1] ** -0.5
    )
    return heads_first(out)[:, :t]


def pallas_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segments: jax.Array | None = None,
    options: AttentionOptions | None = None,
) -> jax.Array:
    """`causal_attention(q, k, v, segments=segments)` as a flash-attention kernel (module docstring).

    q [B, T, Hq, D]; k, v [B, T, Hkv, D] with Hkv dividing Hq; segments [B, T] or None.
    Returns [B, T, Hq, D] in q's dtype.
    """
    opts = options or AttentionOptions()
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    k, v = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))  # query head h reads kv head h // G
    v = v.astype(q.dtype)

    def build(mode: str) -> Callable:
        if mode.startswith("mosaic"):
            return lambda q, k, v, *seg: _tpu_flash(q, k, v, seg[0] if seg else None)
        return lambda q, k, v, *seg: _flash(q, k, v, seg[0] if seg else None, opts, mode == "interpret")

    def run(q, k, v, *seg):
        return per_platform(build, opts.interpret, q, k, v, *seg)

    seg_args = () if segments is None else (segments,)
    layout = mesh_layout()
    if layout is None:
        return run(q, k, v, *seg_args)
    # per (batch, head) shard, the sequence and head_dim whole (a split one is gathered)
    tokens = layout.spec("attention q", ("batch", None, "q_heads", None), q.shape)
    in_specs = [tokens] * 3 + [P(tokens[0], None)] * len(seg_args)
    return run_sharded(run, layout, in_specs, tokens, q, k, v, *seg_args)
