"""A projection for inference (prefill and decode): products accumulated in float32 and rounded once.

    y = round_to(x.dtype, einsum(eq, x, w) accumulated in float32)

This is what a bf16 matmul computes on every backend (XLA:CPU converts both operands to float32;
GPUs and TPUs accumulate bf16 products in float32); asking for the float32 result
(`preferred_element_type`) changes which kernel XLA:CPU picks, and with it the order of the
float32 sums (the last bits), not the arithmetic:

- a bf16 dot with a float32 result goes to XLA:CPU's bf16 library kernel (YNNPACK), which reads
  the weight as stored; one with a bf16 result runs on float32 copies of both operands;
- a product with a single row (decode at batch 1) becomes a float32 matrix-vector product on a
  float32 copy of the weight whatever the result type, so that row is padded to two (the second
  row zero, its result dropped);
- and XLA's bf16 kernel streams a weight at about half the memory bandwidth when the rows are few,
  so products of up to `NATIVE_ROWS` rows go to a native kernel where one runs
  (`jaxpi.kernels.cpu.rows`: the weight read once, as stored, float32 sums), and products of up
  to `PACKED_ROWS` rows, inside `packing()` (the engine's decode loop), to its AVX-512 BF16 kernel
  over the weight packed per strip of 32 columns where the CPU has those instructions (1.3-1.5x
  XLA's product at 16-256 rows). The embedded engine keeps its weights packed once, in twins
  (`jaxpi.models.packed`), and `packed_product` takes any product of 1-256 rows from a twin.

Inside the engine's decode loop XLA hoists those float32 copies out of the loop: each call wrote a
float32 copy of every weight (twice the model's bytes) and each step read it. Weights of float32
(or float64) are left to XLA's own choice: their products are unchanged, bit for bit.

Training keeps `jnp.einsum` in the activation dtype (`jaxpi.models.layers.project`): a float32
result would make the backward's cotangents float32 and every bf16 weight gradient product float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jaxpi.axes import current_resolver
from jaxpi.kernels.cpu import rows

# XLA backends whose bf16 library kernel skips single-row products (see the module docstring).
PAD_SINGLE_ROW = ("cpu",)
# Products of up to this many rows go to the native kernel where it runs (`jaxpi.kernels.cpu.rows`):
# measured on the 2-core CPU against XLA's bf16 kernel, 1.65x at 1 row, 1.44x at 2, level at 4-8.
NATIVE_ROWS = 4
# Inside `packing()`, products of more rows, up to this many, go to the packed AVX-512 BF16 kernel
# where it runs (`rows.packed_bf16`): the weight packed per strip of 32 columns by `rows.pack`.
# Packing reads and writes every weight, so it pays only where it is done once for many products:
# the engine's decode loop, where the weight is loop-invariant and XLA packs it once per call
# before the loop (`JaxEngine` turns it on for calls of many steps). Measured in
# docs/performance.md ("packed strips").
PACKED_ROWS = rows.MAX_PACKED_ROWS
_PACKING = contextvars.ContextVar("jaxpi_dense_packing", default=False)


@contextlib.contextmanager
def packing(on: bool = True) -> Iterator[None]:
    """Products traced inside may use the packed kernel (see `PACKED_ROWS`)."""
    token = _PACKING.set(on)
    try:
        yield
    finally:
        _PACKING.reset(token)


def _rows_times_weight(eq: str, n_in: int) -> bool:
    """Whether `eq` contracts x's last `n_in` axes with w's first ones and keeps the rest in order
    ("btd,dhk->bthk"): then x is a [rows, K] matrix and w a [K, N] one as stored."""
    lhs, rest = eq.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    return lhs[len(lhs) - n_in :] == rhs[:n_in] and out == lhs[: len(lhs) - n_in] + rhs[n_in:]


def _native_kernel(m: int) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
    """The native product `(x [m, K], w [K, N]) -> float32 [m, N]` for `m` rows, or None for XLA's."""
    if m <= NATIVE_ROWS and rows.available():
        return rows.rows_bf16
    if NATIVE_ROWS < m <= PACKED_ROWS and _PACKING.get() and rows.packed_available():
        return lambda x, w: rows.packed_bf16(x, rows.pack(w), w.shape[1])
    return None


def packed_product(
    eq: str, x: jax.Array, packed: jax.Array, shape: tuple[int, ...], *, n_in: int = 1
) -> jax.Array | None:
    """`dense(eq, x, w)` from w's packed twin (`rows.pack` of w `shape` as `[K, N]`,
    `jaxpi.models.packed`) on the packed kernel, in x's dtype; None where that kernel does not take
    this product (more than `PACKED_ROWS` rows, not bf16, under a mesh): the caller then uses w."""
    if x.dtype != jnp.bfloat16 or current_resolver() is not None or not _rows_times_weight(eq, n_in):
        return None
    lead = x.shape[: x.ndim - n_in]
    m = math.prod(lead)
    if not 1 <= m <= PACKED_ROWS or not rows.packed_available():
        return None
    k, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    y = rows.packed_bf16(x.reshape(m, k), packed, n)
    return y.reshape(*lead, *shape[n_in:]).astype(x.dtype)


def dense(eq: str, x: jax.Array, w: jax.Array, *, n_in: int = 1) -> jax.Array:
    """`einsum(eq, x, w)` with float32 accumulation, in x's dtype. `eq` contracts the last `n_in`
    axes of x with leading axes of w; x's other axes are rows (e.g. "btd,df->btf", n_in 1)."""
    if jnp.dtype(w.dtype).itemsize >= 4:  # float32 / float64: XLA's own product, unchanged
        return jnp.einsum(eq, x, w)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    lead = x.shape[: x.ndim - n_in]
    m = math.prod(lead)
    kernel = (
        _native_kernel(m) if x.dtype == w.dtype == jnp.bfloat16 and _rows_times_weight(eq, n_in) else None
    )
    if kernel is not None and current_resolver() is None:  # no mesh: one device runs the custom call
        k = math.prod(w.shape[:n_in])
        y = kernel(x.reshape(m, k), w.reshape(k, -1))
        return y.reshape(*lead, *w.shape[n_in:]).astype(x.dtype)
    if lead and all(n == 1 for n in lead) and jax.default_backend() in PAD_SINGLE_ROW:
        padded = jnp.concatenate([x, jnp.zeros_like(x)], axis=0)  # two rows along the first axis
        return jnp.einsum(eq, padded, w, preferred_element_type=acc)[:1].astype(x.dtype)
    return jnp.einsum(eq, x, w, preferred_element_type=acc).astype(x.dtype)
