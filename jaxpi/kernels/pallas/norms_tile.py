"""The fused norms' equations on one loaded tile of rows, forward and backward.

Pure functions of float32 arrays, shared by the GPU kernels (a loop over row tiles inside each
program) and the TPU kernels (one block of rows per grid step): the same equations as
`jaxpi.kernels.norms`, see its docstring. Shapes: x, z, dy [R, Dp]; w [1, Dp]. `d` is the true
feature count: on GPU the tile is padded to Dp = next power of two with zeros, which add nothing
to the sums below, so every mean is a sum divided by d rather than `jnp.mean` over Dp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inv_rms(x: jax.Array, d: int, eps: float) -> jax.Array:
    """r = rsqrt(mean_d(x²) + eps) per row: [R, Dp] -> [R, 1]."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / d + eps)


def forward_tile(x: jax.Array, w: jax.Array, z: jax.Array | None, d: int, eps: float) -> jax.Array:
    """y = x̂ · (1 + w), or with a gate z: y = w · x̂ · silu(z)."""
    xh = x * inv_rms(x, d, eps)
    if z is None:
        return xh * (1.0 + w)
    return w * xh * (z * jax.nn.sigmoid(z))


def backward_tile(
    x: jax.Array, w: jax.Array, z: jax.Array | None, dy: jax.Array, d: int, eps: float
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(dx, dz or None, dw_rows): dw_rows [R, Dp] is each row's term of dw = Σ_rows dy · x̂ (· silu(z)).

    With s the effective scale (1 + w, or w · silu(z)) and ĝ = dy · s:
        dx = r · (ĝ − x̂ · mean_d(ĝ · x̂)),   dz = dy · w · x̂ · silu'(z).
    r is recomputed from x rather than saved: the row is on chip anyway.
    """
    r = inv_rms(x, d, eps)
    xh = x * r
    if z is None:
        g, dz, dw_rows = dy * (1.0 + w), None, dy * xh
    else:
        sig = jax.nn.sigmoid(z)
        silu = z * sig
        # silu'(z) = σ(z) · (1 + z · (1 − σ(z))), from the σ already computed
        dz = dy * w * xh * (sig * (1.0 + z * (1.0 - sig)))
        g, dw_rows = dy * w * silu, dy * xh * silu
    # ĝ's component along x̂ drops out: scaling a row leaves its x̂ unchanged
    dx = r * (g - xh * (jnp.sum(g * xh, axis=-1, keepdims=True) / d))
    return dx, dz, dw_rows
