"""The fused norms as Pallas kernels (forward and backward): the contract, options, dispatch and
`custom_vjp`. The kernels are in `norms_gpu` (Triton, and Pallas' generic interpreter on CPU) and
`norms_tpu` (Mosaic), the per-tile equations in `norms_tile`.

Same functions as `jaxpi.kernels.norms` (the plain-JAX reference and the CPU path):

    zero-centred RMSNorm   y = x̂ · (1 + w)            x̂ = x · rsqrt(mean_d(x²) + eps)
    gated RMSNorm          y = w · x̂ · silu(z)

computed in float32 whatever the input dtype and cast back; backward as in that module's
docstring (dx, dz per row; dw = Σ_rows). x [..., D] is flattened to rows [R, D] (a free reshape)
and the grid tiles the rows, a block of rows × the whole feature axis per program, so each row's
mean is a reduction inside one program. The forward saves only its inputs; the backward kernel
recomputes r from the x row it loads anyway.

dw is the one reduction across rows. The kernels write one partial sum per row block
([blocks, D] float32) and JAX adds them: the blocks run in parallel, and a single accumulator
would need atomics on GPU (float sums in a non-deterministic order) or a sequential grid axis on
TPU. The partials cost 2/block_rows of x's size at bf16: 1/32 at 64 rows per block, but GPU
blocks shrink for short inputs (to fill the SMs), down to one row, where they outweigh a small x.

Platforms: `interpret=None` chooses at lowering time (`lax.platform_dependent`): Triton on GPU,
Mosaic on TPU, the GPU kernels in Pallas' interpreter on CPU. `interpret=True` forces that
interpreter everywhere, `interpret="tpu"` runs the TPU kernels in Pallas' TPU interpreter (on CPU:
how the tests check them), False compiles only. Interpreted timings say nothing about hardware.
`inject_bug` (the parity harness's known-bad backward passes) applies to the plain-JAX path only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxpi.kernels.pallas.dispatch import per_platform
from jaxpi.kernels.pallas.norms_gpu import gpu_backward, gpu_forward
from jaxpi.kernels.pallas.norms_tpu import tpu_backward, tpu_forward
from jaxpi.kernels.pallas.sharded import sharded_norm

# GPU programs take up to this many rows (in tiles of `tile_rows`): the dw partials are then 1/64 of
# the rows; fewer when that leaves fewer than two programs per SM of an H100/H200 (132 SMs)
_GPU_BLOCK_ROWS = 64
_GPU_MIN_PROGRAMS = 264


@dataclasses.dataclass(frozen=True)
class NormOptions:
    """How the kernels run. `block_rows`: rows per program (None: per platform, GPU up to 64,
    TPU ~2^18 / D rounded to 16); on GPU a power of two, on TPU a multiple of 8. `tile_rows`: rows
    per loop step of a GPU program (None: ~2048 elements per tile), a power of two. `interpret`:
    None = interpret on CPU, compile on GPU/TPU; True = the generic interpreter everywhere; "tpu" =
    the TPU kernels in Pallas' TPU interpreter; False = compile only. `num_warps`: Triton's (None:
    from the tile size). None of the defaults has been tuned on hardware yet."""

    block_rows: int | None = None
    tile_rows: int | None = None
    interpret: bool | str | None = None
    num_warps: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_rows", "tile_rows", "num_warps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.tile_rows is not None and self.tile_rows & (self.tile_rows - 1):
            raise ValueError(f"tile_rows must be a power of two (Triton's tile rule), got {self.tile_rows}")
        if self.interpret not in (None, True, False, "tpu"):
            raise ValueError(f"interpret must be None, True, False or 'tpu', got {self.interpret!r}")

    def gpu_block_rows(self, rows: int) -> int:
        if self.block_rows is None:
            # halve the block while that gives the GPU fewer than _GPU_MIN_PROGRAMS programs (short
            # inputs); the floor is one tile per program
            block, floor = _GPU_BLOCK_ROWS, self.tile_rows or 1
            while block > floor and -(-rows // block) < _GPU_MIN_PROGRAMS:
                block //= 2
            return block
        if self.block_rows & (self.block_rows - 1):
            raise ValueError(
                f"block_rows ({self.block_rows}) must be a power of two on GPU (Triton's tile rule)"
            )
        return self.block_rows


def _rows(a: jax.Array) -> jax.Array:
    # [..., D] -> [R, D]: the feature axis is the minor one, so no copy
    return a.reshape(-1, a.shape[-1])


def _forward(x: jax.Array, z: jax.Array | None, w: jax.Array, eps: float, opts: NormOptions) -> jax.Array:
    def build(mode: str) -> Callable:
        def run(x2, *rest):
            *z2, w_ = rest
            zz = z2[0] if z2 else None
            if mode.startswith("mosaic"):
                return tpu_forward(
                    x2, zz, w_, eps=eps, block_rows=opts.block_rows, interpret=mode == "mosaic_interpret"
                )
            return gpu_forward(
                x2, zz, w_, eps=eps, block_rows=opts.gpu_block_rows(x2.shape[0]), tile_rows=opts.tile_rows,
                interpret=mode == "interpret", num_warps=opts.num_warps,
            )  # fmt: skip

        return run

    # only arrays pass through platform_dependent: the gate is present or absent, never None
    arrays = (_rows(x), w) if z is None else (_rows(x), _rows(z), w)
    return per_platform(build, opts.interpret, *arrays).reshape(x.shape)


def _backward(x, z, w, dy, eps: float, opts: NormOptions):
    """(dx, dz or None, dw) in the dtypes of x, z and w."""

    def build(mode: str) -> Callable:
        def run(x2, *rest):
            *z2, w_, dy2 = rest
            zz = z2[0] if z2 else None
            if mode.startswith("mosaic"):
                kw = dict(eps=eps, block_rows=opts.block_rows, interpret=mode == "mosaic_interpret")
                dx, dz, dw = tpu_backward(x2, zz, w_, dy2, **kw)
            else:
                kw = dict(eps=eps, block_rows=opts.gpu_block_rows(x2.shape[0]), tile_rows=opts.tile_rows)
                kw.update(interpret=mode == "interpret", num_warps=opts.num_warps)
                dx, dz, dw = gpu_backward(x2, zz, w_, dy2, **kw)
            # dw is already summed over the row blocks: the branches' partials have different
            # layouts ([blocks, D] GPU, [blocks, 1, D] TPU) and platform_dependent needs one result type
            return (dx, dw) if dz is None else (dx, dz, dw)

        return run

    arrays = (_rows(x), w, _rows(dy)) if z is None else (_rows(x), _rows(z), w, _rows(dy))
    dx, *dz, dw = per_platform(build, opts.interpret, *arrays)
    return dx.reshape(x.shape), (dz[0].reshape(z.shape) if dz else None), dw.astype(w.dtype)


def _check_shapes(x: jax.Array, w: jax.Array, z: jax.Array | None = None) -> None:
    """Errors that name the tensor: the kernels index by shape and would read out of bounds otherwise."""
    if x.ndim < 1 or jnp.shape(w) != (x.shape[-1],):
        raise ValueError(f"norm weight has shape {jnp.shape(w)}, expected ({x.shape[-1]},) for x {x.shape}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"gated norm gate has shape {z.shape}, expected x's shape {x.shape}")


# ---- custom_vjp ----------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms(x: jax.Array, w: jax.Array, eps: float, opts: NormOptions) -> jax.Array:
    return _forward(x, None, w, eps, opts)


def _rms_fwd(x, w, eps, opts):
    # residuals: the inputs only (r is recomputed in the backward kernel from the row it loads)
    return _forward(x, None, w, eps, opts), (x, w)


def _rms_bwd(eps, opts, res, dy):
    x, w = res
    dx, _, dw = _backward(x, None, w, dy, eps, opts)
    return dx, dw


_rms.defvjp(_rms_fwd, _rms_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated(x: jax.Array, z: jax.Array, w: jax.Array, eps: float, opts: NormOptions) -> jax.Array:
    return _forward(x, z, w, eps, opts)


def _gated_fwd(x, z, w, eps, opts):
    return _forward(x, z, w, eps, opts), (x, z, w)


def _gated_bwd(eps, opts, res, dy):
    return _backward(*res, dy, eps, opts)


_gated.defvjp(_gated_fwd, _gated_bwd)


def pallas_rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    block_rows: int | None = None,
    tile_rows: int | None = None,
    interpret: bool | str | None = None,
    num_warps: int | None = None,
    axes: Sequence[str | None] | None = None,
) -> jax.Array:
    """`norms.rms_norm` in Pallas: `x̂ · (1 + w)` over the last axis; x [..., D], weight [D].
    Output in x's dtype. `axes`: x's logical axes, read only under a mesh (see `sharded_norm`);
    the other keywords: see `NormOptions`."""
    _check_shapes(x, weight)
    opts = NormOptions(block_rows=block_rows, tile_rows=tile_rows, interpret=interpret, num_warps=num_warps)
    return sharded_norm(lambda x, _, w: _rms(x, w, float(eps), opts), x, None, weight, axes)


def pallas_gated_rms_norm(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    block_rows: int | None = None,
    tile_rows: int | None = None,
    interpret: bool | str | None = None,
    num_warps: int | None = None,
    axes: Sequence[str | None] | None = None,
) -> jax.Array:
    """`norms.gated_rms_norm` in Pallas: `w · x̂ · silu(gate)`; x, gate [..., D], weight [D].
    `axes`: as for `pallas_rms_norm`."""
    _check_shapes(x, weight, gate)
    opts = NormOptions(block_rows=block_rows, tile_rows=tile_rows, interpret=interpret, num_warps=num_warps)
    return sharded_norm(lambda x, z, w: _gated(x, z, w, float(eps), opts), x, gate, weight, axes)
