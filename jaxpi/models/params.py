"""Parameter declaration: one call gives shape, dtype, logical axes and initializer.

Logical axis names used by the model (the `sharding` package maps them onto mesh axes):
`vocab`, `embed`, `mlp`, `q_heads`, `kv_heads`, `head_dim`, `gdn_k_heads`, `gdn_v_heads`,
`conv` (the depthwise conv window) and `layers` (added by the scanned stack). Activations add
`batch` and `seq` (see `constrain`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

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


# ---- activation sharding ------------------------------------------------------------------------
# The model names the logical axes of its activations at block boundaries; whoever runs it under a
# mesh (the `sharding` package) installs a resolver from logical axes to a `jax.sharding.Sharding`.
# With none installed, `constrain` is the identity, so the model stays mesh-agnostic.
ActivationResolver = Callable[[tuple[str | None, ...], tuple[int, ...]], "jax.sharding.Sharding | None"]
_resolver: list[ActivationResolver] = []


@contextlib.contextmanager
def activation_sharding(resolver: ActivationResolver | None) -> Iterator[None]:
    """Trace the model with `resolver(logical_axes, shape)` deciding activation shardings."""
    _resolver.append(resolver)
    try:
        yield
    finally:
        _resolver.pop()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """`with_sharding_constraint` by logical axis names (`batch`, `seq`, `embed`, heads, ...)."""
    if not _resolver or _resolver[-1] is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"activation of shape {x.shape} annotated with {len(axes)} axes {axes}")
    sharding = _resolver[-1](tuple(axes), tuple(x.shape))
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def current_resolver() -> ActivationResolver | None:
    """The resolver the innermost `activation_sharding` installed (None outside one, or if it
    installed None): what kernels that must run per shard (the Pallas calls) read the mesh from."""
    return _resolver[-1] if _resolver else None
