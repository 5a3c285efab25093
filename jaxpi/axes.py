"""Logical axes: the names the model gives the dimensions of its parameters and activations, and
the hook through which whoever runs it under a mesh decides how activations are sharded.

Parameters (declared in `jaxpi.models.params.param`): `vocab`, `embed`, `mlp`, `q_heads`,
`kv_heads`, `head_dim`, `gdn_k_heads`, `gdn_v_heads`, `conv` (the depthwise conv window) and
`layers` (added by the scanned stack). Activations add `batch` and `seq` (see `constrain`).

This module imports only jax: the model and the kernels call `constrain` and `current_resolver`,
the `sharding` package installs resolvers, and neither imports the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax

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
