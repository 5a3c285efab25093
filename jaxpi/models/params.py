"""Parameter declaration: one call gives shape, dtype, logical axes and initializer.

The logical axis names and the activation-sharding hook (`constrain`, `activation_sharding`)
live in `jaxpi.axes`, re-exported here; the `sharding` package maps the names onto mesh axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.axes import ActivationResolver, activation_sharding, constrain, current_resolver

__all__ = [
    "ActivationResolver",
    "Init",
    "activation_sharding",
    "constant",
    "constrain",
    "current_resolver",
    "log_uniform",
    "normal",
    "param",
]

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float = 0.02) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def constant(value: float) -> Init:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def log_uniform(low: float, high: float) -> Init:
    """log(U(low, high)): DeltaNet's A_log, kept away from 0 so that log(A) stays finite."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(
        dtype
    )


def param(
    rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], init: Init, dtype: jnp.dtype
) -> nnx.Param:
    """A parameter annotated with its logical axes (sharding is applied later, never eagerly)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {tuple(axes)} differ in rank")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(axes), eager_sharding=False)
