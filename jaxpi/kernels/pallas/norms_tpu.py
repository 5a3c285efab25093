"""The fused norms for TPU (Mosaic): one [block_rows, D] block of rows per grid step.

Grid (row blocks,), all "parallel" (megacore may split it): each step's blocks are `block_rows`
rows of the flattened [R, D] input with the whole feature axis (a block dim equal to the array's
is always legal; block_rows is a multiple of 8, the sublane tiling, or all of R). The weight and
the backward's partial dw travel as [1, D] rows (Mosaic blocks are at least 2-D). When R is not a
multiple of block_rows, the last block reads rows past R whose contents are unspecified: their
outputs are dropped by Pallas, and the dw partial sum masks them out with `where` (not a
multiplication: the padding may hold NaN or inf).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpi.kernels.pallas.norms_tile import backward_tile, forward_tile

_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel",))


def _forward_kernel(*refs, eps: float, gated: bool):
    """One block: x (, z) [br, D], w [1, D] -> y [br, D]."""
    x_ref, *z_ref, w_ref, y_ref = refs
    z = z_ref[0][...].astype(jnp.float32) if gated else None
    x, w = x_ref[...].astype(jnp.float32), w_ref[...].astype(jnp.float32)
    y_ref[...] = forward_tile(x, w, z, x.shape[1], eps).astype(y_ref.dtype)


def _backward_kernel(*refs, eps: float, gated: bool, rows: int):
    """One block: x (, z), dy [br, D], w [1, D] -> dx (, dz) [br, D], dw_part [1, D] (Σ over this block's rows)."""
    if gated:
        x_ref, z_ref, w_ref, dy_ref, dx_ref, dz_ref, dw_ref = refs
    else:
        (x_ref, w_ref, dy_ref, dx_ref, dw_ref), z_ref, dz_ref = refs, None, None
    x, w, dy = (r[...].astype(jnp.float32) for r in (x_ref, w_ref, dy_ref))
    z = z_ref[...].astype(jnp.float32) if gated else None
    dx, dz, dw_rows = backward_tile(x, w, z, dy, x.shape[1], eps)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    if gated:
        dz_ref[...] = dz.astype(dz_ref.dtype)
    block = x.shape[0]
    row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    dw_ref[...] = jnp.sum(jnp.where(row < rows, dw_rows, 0.0), axis=0, keepdims=True)


def _call(kernel, arrays, out_shape, *, block_rows: int, interpret: bool, name: str):
    rows, d = arrays[0].shape
    row_block = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
    # the same weight block at every step: the pipeline fetches it once
    weight = pl.BlockSpec((1, d), lambda i: (0, 0))
    partial = pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0))
    in_specs = [weight if a.ndim == 1 else row_block for a in arrays]
    out_specs = [partial if len(o.shape) == 3 else row_block for o in out_shape]
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_SEMANTICS,
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*(a[None, :] if a.ndim == 1 else a for a in arrays))


def block_rows_for(rows: int, d: int, block_rows: int | None) -> int:
    """Rows per grid step: ~2^18 elements (1 MiB of float32 per tile), a multiple of 16 (bf16's
    sublane packing) from 16 to 1024, or all of R when that is fewer. Several fp32 temporaries of
    this size and the double-buffered inputs and outputs stay within 16 MiB of scoped VMEM at D = 5120."""
    if block_rows is None:
        block_rows = min(max(16, (2**18 // d) // 16 * 16), 1024)
    elif block_rows % 8:
        raise ValueError(f"block_rows ({block_rows}) must be a multiple of 8 on TPU (the sublane tiling)")
    return min(block_rows, rows)


def tpu_forward(
    x: jax.Array, z: jax.Array | None, w: jax.Array, *, eps: float, block_rows: int | None, interpret: bool
) -> jax.Array:
    """y [R, D] in x's dtype from x (, z) [R, D] and w [D]."""
    gated = z is not None
    arrays = (x, z, w) if gated else (x, w)
    return _call(
        functools.partial(_forward_kernel, eps=eps, gated=gated),
        arrays,
        [jax.ShapeDtypeStruct(x.shape, x.dtype)],
        block_rows=block_rows_for(*x.shape, block_rows),
        interpret=interpret,
        name="gated_rms_norm_forward" if gated else "rms_norm_forward",
    )[0]


def tpu_backward(
    x: jax.Array,
    z: jax.Array | None,
    w: jax.Array,
    dy: jax.Array,
    *,
    eps: float,
    block_rows: int | None,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(dx [R, D], dz [R, D] or None, dw [D] float32)."""
    gated = z is not None
    rows, d = x.shape
    block = block_rows_for(rows, d, block_rows)
    arrays = (x, z, w, dy) if gated else (x, w, dy)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_shape += [jax.ShapeDtypeStruct(z.shape, z.dtype)] if gated else []
    out_shape += [jax.ShapeDtypeStruct((pl.cdiv(rows, block), 1, d), jnp.float32)]
    dx, *dz, dw_part = _call(
        functools.partial(_backward_kernel, eps=eps, gated=gated, rows=rows),
        arrays,
        out_shape,
        block_rows=block,
        interpret=interpret,
        name="gated_rms_norm_backward" if gated else "rms_norm_backward",
    )
    # per-block partial sums keep the grid "parallel" (no step waits on another's accumulator);
    # [blocks, 1, D] is ~2/block_rows of x's size, summed here
    return dx, (dz[0] if dz else None), jnp.sum(dw_part, axis=(0, 1))
