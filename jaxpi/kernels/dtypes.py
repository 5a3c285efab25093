"""The compute dtype of the plain-JAX kernels: float32 at least, float64 when the inputs are.

Every kernel upcasts bf16/fp16 inputs to float32 (as `transformers` does) and keeps float64 inputs
in float64, so that with `jax_enable_x64` the same code runs in double precision: the parity
harness uses that to tell our algorithm's rounding from its maths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compute_dtype(*xs: jax.Array | jnp.dtype) -> jnp.dtype:
    """The widest of the inputs' dtypes and float32."""
    dtypes = [x if isinstance(x, jnp.dtype) else jnp.asarray(x).dtype for x in xs]
    return jnp.dtype(jnp.promote_types(jnp.result_type(*dtypes), jnp.float32))


def upcast(x: jax.Array) -> jax.Array:
    """x in float32, or in float64 if it already is."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
