"""One chunk of the gated delta rule's recurrence, forward and backward, on loaded tiles.

Pure functions of arrays, shared by the GPU kernels (which loop over chunks inside a program) and
the TPU kernels (one chunk per grid step): the same equations in both, see `pallas.gdn`.
Shapes per (batch, head) program: U [C, bv], W / Q_r / K_w [C, K], P [C, C], d [K, 1] (the
chunk-end decay of every key row), S / dS [K, bv], dO [C, bv]; bv is the block of Dv columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_CONTRACT = {"nn": ((1,), (0,)), "tn": ((0,), (0,)), "nt": ((1,), (1,))}


def mm(a: jax.Array, b: jax.Array, form: str, precision: jax.lax.Precision) -> jax.Array:
    """2-D matmul, float32 accumulation: "nn" a·b, "tn" aᵀ·b, "nt" a·bᵀ (the forms Triton's dot takes)."""
    return jax.lax.dot_general(
        a, b, (_CONTRACT[form], ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def forward_chunk(
    u: jax.Array, w: jax.Array, qr: jax.Array, p: jax.Array, kw: jax.Array, d: jax.Array, s: jax.Array,
    precision: jax.lax.Precision,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(O [C, bv], S' [K, bv]) from the state S entering the chunk."""
    delta = u - mm(w, s, "nn", precision)  # Δ = U − W S
    out = mm(qr, s, "nn", precision) + mm(p, delta, "nn", precision)  # O = Q_r S + P Δ
    return out, d * s + mm(kw, delta, "tn", precision)  # S' = d ⊙_row S + K_wᵀ Δ


def backward_chunk(
    u: jax.Array, w: jax.Array, qr: jax.Array, p: jax.Array, kw: jax.Array, d: jax.Array, s: jax.Array,
    dout: jax.Array, ds: jax.Array, precision: jax.lax.Precision,
) -> tuple[tuple[jax.Array, ...], jax.Array]:  # fmt: skip
    """((dU, dW, dQ_r, dP, dK_w), dS) from the saved S and dS' = ds (dd is left to the caller:
    Σ_v S ⊙ dS', whose layout differs by platform). Δ is recomputed here, not saved."""
    delta = u - mm(w, s, "nn", precision)
    ddelta = mm(p, dout, "tn", precision) + mm(kw, ds, "nn", precision)  # dΔ = Pᵀ dO + K_w dS'
    grads = (
        ddelta,  # dU
        -mm(ddelta, s, "nt", precision),  # dW = −dΔ Sᵀ
        mm(dout, s, "nt", precision),  # dQ_r = dO Sᵀ
        mm(dout, delta, "nt", precision),  # dP = dO Δᵀ
        mm(delta, ds, "nt", precision),  # dK_w = Δ dS'ᵀ
    )
    # dS = d ⊙_row dS' + Q_rᵀ dO − Wᵀ dΔ
    return grads, d * ds + mm(qr, dout, "tn", precision) - mm(w, ddelta, "tn", precision)
