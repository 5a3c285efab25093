"""The fused norms for GPU (Triton) and Pallas' generic interpreter.

Grid (row blocks,): one program per `block_rows` rows of the flattened [R, D] input; it steps
through its block `tile_rows` rows at a time (`fori_loop`), each step one [tile_rows, Dp] tile
with the whole feature axis. Triton tiles must hold a power-of-two number of elements, so Dp is D
rounded up to a power of two (5120 -> 8192) and the loads and stores are masked: padded columns
load as zeros, and rows past R (the last block when R is not a multiple of block_rows) load as
zeros and are never stored. The refs are the whole arrays (no BlockSpec): the program computes its
own row and column indices, which is what lets the tile be wider than D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpi.kernels.pallas.norms_tile import backward_tile, forward_tile


def _tile_at(i: jax.Array, tile_rows: int, d_pad: int, shape: tuple[int, int]):
    """Index arrays and mask of row tile i (global tile number) of an [R, D] array."""
    rows, d = shape
    r = i * tile_rows + jnp.arange(tile_rows)
    c = jnp.arange(d_pad)
    return (r[:, None], c[None, :]), (r < rows)[:, None] & (c < d)[None, :]


def _load(ref, idx, mask) -> jax.Array:
    return plt.load(ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)


def _load_weight(w_ref, d_pad: int) -> jax.Array:
    c = jnp.arange(d_pad)
    return plt.load(w_ref.at[c], mask=c < w_ref.shape[0], other=0.0).astype(jnp.float32)[None, :]


def _forward_kernel(*refs, eps: float, gated: bool, block_rows: int, tile_rows: int, d_pad: int):
    """x (, z) [R, D], w [D] -> y [R, D]."""
    x_ref, *z_ref, w_ref, y_ref = refs
    w = _load_weight(w_ref, d_pad)  # once per program, reused by every row tile
    steps = block_rows // tile_rows
    # read outside the loop: the generic interpreter substitutes program ids at the kernel's top level
    first = pl.program_id(0) * steps

    def step(s: jax.Array, carry: None) -> None:
        idx, mask = _tile_at(first + s, tile_rows, d_pad, x_ref.shape)
        z = _load(z_ref[0], idx, mask) if gated else None
        y = forward_tile(_load(x_ref, idx, mask), w, z, x_ref.shape[1], eps)
        plt.store(y_ref.at[idx], y.astype(y_ref.dtype), mask=mask)
        return carry

    jax.lax.fori_loop(0, steps, step, None)


def _backward_kernel(*refs, eps: float, gated: bool, block_rows: int, tile_rows: int, d_pad: int):
    """x (, z) [R, D], w [D], dy [R, D] -> dx (, dz) [R, D], dw_part [blocks, D] (this block's Σ_rows)."""
    if gated:
        x_ref, z_ref, w_ref, dy_ref, dx_ref, dz_ref, dw_ref = refs
    else:
        (x_ref, w_ref, dy_ref, dx_ref, dw_ref), z_ref, dz_ref = refs, None, None
    w = _load_weight(w_ref, d_pad)
    steps = block_rows // tile_rows
    d = x_ref.shape[1]
    block, first = pl.program_id(0), pl.program_id(0) * steps

    def step(s: jax.Array, dw_acc: jax.Array) -> jax.Array:
        idx, mask = _tile_at(first + s, tile_rows, d_pad, x_ref.shape)
        z = _load(z_ref, idx, mask) if gated else None
        dx, dz, dw_rows = backward_tile(_load(x_ref, idx, mask), w, z, _load(dy_ref, idx, mask), d, eps)
        plt.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)
        if gated:
            plt.store(dz_ref.at[idx], dz.astype(dz_ref.dtype), mask=mask)
        # masked rows loaded dy = 0, so they add nothing to dw
        return dw_acc + jnp.sum(dw_rows, axis=0)

    dw = jax.lax.fori_loop(0, steps, step, jnp.zeros((d_pad,), jnp.float32))
    c = jnp.arange(d_pad)
    plt.store(dw_ref.at[block, c], dw, mask=c < d)


def tile_rows_for(d: int, block_rows: int, tile_rows: int | None) -> int:
    """Rows per loop step: ~2048 fp32 elements per tile (registers, not shared memory), at least 1."""
    if tile_rows is None:
        tile_rows = max(1, 2048 // pl.next_power_of_2(d))
    return min(tile_rows, block_rows)


def _call(kernel, arrays, out_shape, *, eps, gated, block_rows, tile_rows, interpret, num_warps):
    rows, d = arrays[0].shape
    d_pad = pl.next_power_of_2(d)
    tile = tile_rows_for(d, block_rows, tile_rows)
    if num_warps is None:  # one warp per 256 tile elements, 1 to 8 (Triton's layer-norm heuristic)
        num_warps = min(max(tile * d_pad // 256, 1), 8)
    body = functools.partial(kernel, eps=eps, gated=gated, block_rows=block_rows, tile_rows=tile, d_pad=d_pad)
    return pl.pallas_call(
        body,
        grid=(pl.cdiv(rows, block_rows),),
        out_shape=out_shape,
        interpret=interpret,
        # one stage: software pipelining serves loops of dots; each tile here is loaded once
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=("gated_rms_norm_" if gated else "rms_norm_") + kernel.__name__.split("_")[1],
    )(*arrays)


def gpu_forward(
    x: jax.Array,
    z: jax.Array | None,
    w: jax.Array,
    *,
    eps: float,
    block_rows: int,
    tile_rows: int | None,
    interpret: bool,
    num_warps: int | None,
) -> jax.Array:
    """y [R, D] in x's dtype from x (, z) [R, D] and w [D]."""
    arrays = (x, w) if z is None else (x, z, w)
    return _call(
        _forward_kernel, arrays, jax.ShapeDtypeStruct(x.shape, x.dtype), eps=eps, gated=z is not None,
        block_rows=block_rows, tile_rows=tile_rows, interpret=interpret, num_warps=num_warps,
    )  # fmt: skip


def gpu_backward(
    x: jax.Array,
    z: jax.Array | None,
    w: jax.Array,
    dy: jax.Array,
    *,
    eps: float,
    block_rows: int,
    tile_rows: int | None,
    interpret: bool,
    num_warps: int | None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(dx [R, D], dz [R, D] or None, dw [D] float32)."""
    rows, d = x.shape
    arrays = (x, w, dy) if z is None else (x, z, w, dy)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_shape += [] if z is None else [jax.ShapeDtypeStruct(z.shape, z.dtype)]
    out_shape += [jax.ShapeDtypeStruct((pl.cdiv(rows, block_rows), d), jnp.float32)]
    outs = _call(
        _backward_kernel, arrays, out_shape, eps=eps, gated=z is not None,
        block_rows=block_rows, tile_rows=tile_rows, interpret=interpret, num_warps=num_warps,
    )  # fmt: skip
    dx, *dz, dw_part = outs
    # the row blocks run in parallel programs: each writes its own partial dw and they are summed
    # here, rather than racing on one [D] accumulator with atomics (non-deterministic float order)
    return dx, (dz[0] if dz else None), jnp.sum(dw_part, axis=0)
