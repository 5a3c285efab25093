"""Fused RMSNorm kernels with hand-written backward passes (`jax.custom_vjp`).

Two norms live in Qwen3.5:

- zero-centred RMSNorm (every block norm, final norm, per-head q/k norms):

      r  = rsqrt(mean_d(x_d²) + eps)          x̂ = x · r          y = x̂ · (1 + w)

  (Qwen3's plain RMSNorm is the same with offset 0: y = x̂ · w);

- gated RMSNorm (the Gated DeltaNet output norm; plain weight, initialised to 1):

      y = w · x̂ · silu(z)

Both are computed in float32 whatever the input dtype and cast back, as `transformers` does.
The backward passes, with s the effective scale (1 + w, or w · silu(z)) and ĝ = dy · s:

      dw  = Σ_rows dy · x̂             (gated: Σ_rows dy · x̂ · silu(z))
      dx  = r · (ĝ − x̂ · mean_d(ĝ · x̂))
      dz  = dy · w · x̂ · silu'(z)     (gated only)

The forward saves only x (and z) and recomputes r, as a fused kernel does.

`inject_bug(name)` (`jaxpi.kernels.inject`) swaps in a known-bad backward (the forward is
untouched) so that the parity harness can prove it catches the class of bug where a fused norm
keeps the loss and changes the gradients (see `KNOWN_BUGS`).

`impl="pallas"` runs the same functions as Pallas kernels (`jaxpi.kernels.pallas.norms`); these
plain-JAX versions stay the reference and the CPU path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxpi.kernels.dtypes import upcast
from jaxpi.kernels.inject import NORM_BUGS, active
from jaxpi.kernels.inject import inject_bug as inject_bug  # re-exported: the norms' bugs live here

IMPLS = ("jax", "pallas")
KNOWN_BUGS = NORM_BUGS  # the norms' share of `jaxpi.kernels.inject.KNOWN_BUGS`


def _rsqrt_ms(x32: jax.Array, eps: float) -> jax.Array:
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _sum_rows(a: jax.Array) -> jax.Array:
    return jnp.sum(a.reshape(-1, a.shape[-1]), axis=0)


# ---- zero-centred RMSNorm ----------------------------------------------------------------------


def _rms_fwd_math(x: jax.Array, w: jax.Array, eps: float, offset: float = 1.0) -> jax.Array:
    x32 = upcast(x)
    y = x32 * _rsqrt_ms(x32, eps) * (offset + upcast(w))
    return y.astype(x.dtype)


def _make_rms_norm(bug: str | None):
    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
    def rms(x: jax.Array, w: jax.Array, eps: float, offset: float) -> jax.Array:
        return _rms_fwd_math(x, w, eps, offset)

    def fwd(x, w, eps, offset):
        return _rms_fwd_math(x, w, eps, offset), (x, w)

    def bwd(eps, offset, res, dy):
        x, w = res
        x32, dy32, w32 = upcast(x), upcast(dy), upcast(w)
        r = _rsqrt_ms(x32, eps)
        xh = x32 * r
        scale = w32 if bug == "rmsnorm-dx-no-offset" else offset + w32
        g = dy32 * scale
        if bug == "rmsnorm-dx-double-weight":
            dx = r * (g - xh * jnp.mean(g * (offset + w32) * xh, axis=-1, keepdims=True))
        else:
            dx = r * (g - xh * jnp.mean(g * xh, axis=-1, keepdims=True))
        dw = _sum_rows(dy32 * xh)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    rms.defvjp(fwd, bwd)
    return rms


def _make_gated_norm(bug: str | None):
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def gated(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
        return _gated_fwd_math(x, z, w, eps)

    def fwd(x, z, w, eps):
        return _gated_fwd_math(x, z, w, eps), (x, z, w)

    def bwd(eps, res, dy):
        x, z, w = res
        x32, z32, w32 = upcast(x), upcast(z), upcast(w)
        dy32 = upcast(dy)
        r = _rsqrt_ms(x32, eps)
        xh = x32 * r
        sig = jax.nn.sigmoid(z32)
        silu = z32 * sig
        dsilu = sig * (1.0 + z32 * (1.0 - sig))
        dz = dy32 * w32 * xh * dsilu
        gate = 1.0 if bug == "gated-norm-pre-gate" else silu
        g = dy32 * w32 * gate
        dx = r * (g - xh * jnp.mean(g * xh, axis=-1, keepdims=True))
        dw = _sum_rows(dy32 * xh * gate)
        return dx.astype(x.dtype), dz.astype(z.dtype), dw.astype(w.dtype)

    gated.defvjp(fwd, bwd)
    return gated


def _gated_fwd_math(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = upcast(x)
    y = upcast(w) * (x32 * _rsqrt_ms(x32, eps)) * jax.nn.silu(upcast(z))
    return y.astype(x.dtype)


_RMS = {b: _make_rms_norm(b) for b in (None, "rmsnorm-dx-no-offset", "rmsnorm-dx-double-weight")}
_GATED = {b: _make_gated_norm(b) for b in (None, "gated-norm-pre-gate")}


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    impl: str = "jax",
    axes: Sequence[str | None] | None = None,
    offset: float = 1.0,
) -> jax.Array:
    """Zero-centred RMSNorm over the last axis: `x̂ · (1 + w)`; x `[..., D]`, weight `[D]`.
    `offset` 0.0 gives the plain RMSNorm `x̂ · w` (Qwen3).

    impl: "jax" (these custom_vjp functions: the reference and the CPU path) or "pallas" (the same
    math as Pallas kernels, `jaxpi.kernels.pallas.norms`: compiled on GPU/TPU, interpreted on CPU).
    `inject_bug` swaps the backward of the "jax" path only; the Pallas kernels ignore it.
    `axes`: x's logical axes, read by the Pallas path under a mesh (which dims its shard_map
    splits); the plain path needs none (XLA partitions it).
    """
    if impl == "jax":
        return _RMS.get(active(), _RMS[None])(x, weight, eps, float(offset))
    if impl == "pallas":
        # imported here: the Pallas kernels are only traced when asked for
        from jaxpi.kernels.pallas.norms import pallas_rms_norm

        # the kernel is zero-centred: x̂ · (offset + w) = x̂ · (1 + (w + offset - 1)), the same
        # gradient for w; shifted in float32, where a 16-bit weight's shift is exact
        if offset != 1.0:
            weight = upcast(weight) + (offset - 1.0)
        return pallas_rms_norm(x, weight, eps, axes=axes)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def gated_rms_norm(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    impl: str = "jax",
    axes: Sequence[str | None] | None = None,
) -> jax.Array:
    """Gated RMSNorm over the last axis: `w · x̂ · silu(gate)`; x, gate `[..., D]`, weight `[D]`.

    impl, axes: as for `rms_norm` (`inject_bug` applies to "jax" only).
    """
    if impl == "jax":
        return _GATED.get(active(), _GATED[None])(x, gate, weight, eps)
    if impl == "pallas":
        from jaxpi.kernels.pallas.norms import pallas_gated_rms_norm

        return pallas_gated_rms_norm(x, gate, weight, eps, axes=axes)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float = 1e-6, offset: float = 1.0) -> jax.Array:
    """The same function left to autodiff (the kernels' test oracle)."""
    return _rms_fwd_math(x, weight, eps, offset)


def gated_rms_norm_reference(
    x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float = 1e-6
) -> jax.Array:
    return _gated_fwd_math(x, gate, weight, eps)
