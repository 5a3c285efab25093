"""A frozen quantized base weight that `project` reads like a parameter: `QuantizedWeight`.

A projection attribute (`mixer.q_proj`) holds either an `nnx.Param` `[*in, *out]` or a
`QuantizedWeight`: a module whose `QuantParam` variables are the stored arrays of
`jaxpi.quant.stored` (NF4 codes and double-quantized scales, or int8 codes and row scales), each
with its logical axes, stacked over layer groups like the weight they replace. The layer code is
the same for both; only `project` asks which one it has.

    y = einsum(eq, x, dequantize(arrays))          forward: the weight rebuilt in x's dtype
    dx = einsumᵀ(eq, dy, dequantize(arrays))       backward: rebuilt again, no weight gradient

`quantized_einsum` is a custom VJP so that the backward keeps only the stored arrays, never the
dequantized weight: without remat, autodiff would save every layer's rebuilt weight in the
compute dtype (2 bytes per parameter in bf16, four times the NF4 base). The arrays are frozen
(`QuantParam`, not `nnx.Param`): nothing differentiates, trains or merges them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.models.params import constrain
from jaxpi.quant.stored import Layout, dequantize


class QuantParam(nnx.Variable):
    """Stored arrays of a quantized frozen base weight (codes, block scales): never trained."""


class QuantizedWeight(nnx.Module):
    """One projection's quantized weight: `layout` (static) and one `QuantParam` per stored array.

    `stacked` is the number of layer groups the arrays are stacked over (0 in the unrolled tail);
    `axes` the logical axes of the dense weight it replaces (with `layers` first when stacked),
    which LoRA factors copy.
    """

    def __init__(
        self, layout: Layout, arrays: dict[str, QuantParam], *, axes: tuple[str | None, ...], stacked: int = 0
    ):
        self.layout = layout
        self.stacked = stacked
        self.axes = tuple(axes)
        self.names = tuple(arrays)
        for name, var in arrays.items():
            setattr(self, name, var)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape, with the stacked axis (what a `Param` would have)."""
        return ((self.stacked,) if self.stacked else ()) + self.layout.shape

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.names}

    def gathered(self) -> dict[str, jax.Array]:
        """One layer's arrays laid out for their use (the activation table applied to their axes:
        whole over fsdp, still split over tensor), so that a sharded step gathers the 4-bit codes
        and dequantizes after, rather than dequantizing shards and gathering the rebuilt weight
        (XLA:CPU's choice without it: 9.5x the bytes). A no-op outside a sharded step."""
        per = self.layout.axes(self.axes[1:] if self.stacked else self.axes)
        return {name: constrain(a, per[name]) for name, a in self.arrays().items()}

    def dequantize(self, dtype: jnp.dtype) -> jax.Array:
        """The weight `[*in, *out]` in `dtype` (one layer: call it inside the group scan)."""
        return dequantize(self.arrays(), self.layout, jnp.dtype(dtype))


def weight_shape_axes(w: nnx.Variable | QuantizedWeight) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """(shape, logical axes) of a projection's weight as the dense `Param` has (or would have) them."""
    if isinstance(w, QuantizedWeight):
        return w.shape, w.axes
    return tuple(w.get_value().shape), tuple(w.get_metadata().get("out_sharding") or ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def quantized_einsum(eq: str, x: jax.Array, arrays: dict[str, jax.Array], layout: Layout) -> jax.Array:
    """`einsum(eq, x, ŵ)` with ŵ dequantized from `arrays` in x's dtype (module docstring)."""
    with jax.named_scope("dequantize"):
        w = dequantize(arrays, layout, x.dtype)
    return jnp.einsum(eq, x, w)


def _qe_fwd(eq: str, x: jax.Array, arrays: dict, layout: Layout) -> tuple[jax.Array, tuple]:
    # Residuals: the stored arrays (already live as parameters) and x's type, not ŵ or x.
    return quantized_einsum(eq, x, arrays, layout), (arrays, jax.ShapeDtypeStruct(x.shape, x.dtype))


def _qe_bwd(eq: str, layout: Layout, res: tuple, dy: jax.Array) -> tuple[jax.Array, dict]:
    arrays, x_type = res
    with jax.named_scope("dequantize"):
        w = dequantize(arrays, layout, x_type.dtype)
    (dx,) = jax.linear_transpose(lambda x: jnp.einsum(eq, x, w), x_type)(dy.astype(x_type.dtype))
    # The stored arrays are integers and frozen scales: zero cotangents.
    zeros = jax.tree.map(_zero_cotangent, arrays)
    return dx, zeros


def _zero_cotangent(a: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return jnp.zeros(a.shape, jax.dtypes.float0)


quantized_einsum.defvjp(_qe_fwd, _qe_bwd)


def base_einsum(mod: nnx.Module, proj: str, eq: str, x: jax.Array) -> jax.Array:
    """`einsum(eq, x, W)` for the stored projection `proj` of `mod`, dense or quantized."""
    w = getattr(mod, proj)
    if isinstance(w, QuantizedWeight):
        return quantized_einsum(eq, x, w.gathered(), w.layout)
    return jnp.einsum(eq, x, w[...])
