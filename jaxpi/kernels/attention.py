"""The attention core (grouped-query, causal, segment-masked) and partial rotary embeddings.

    s_{b,h,t,u} = (q_{b,t,h} · k_{b,u,h/G}) / sqrt(d)      G = query heads per kv head
    s           = -inf where u > t (by position), or segments differ, or the key slot is empty
    o_{b,t,h}   = Σ_u softmax_u(s)_{b,h,t,u} · v_{b,u,h/G}

Scores and softmax are float32 whatever the inputs' dtype (as `transformers` does); float64 inputs
stay float64.

`causal_attention` is the same core for a sequence attending to itself (training, prefill without
a cache), computed in query blocks: block i reads only keys up to its own end, so the fully
masked upper triangle of `s` is never computed, stored or differentiated (about half the work
and memory of the [T, T] scores), and the causal mask is a constant per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.kernels.dtypes import compute_dtype

_NEG = -1e30  # finite "minus infinity": a fully masked row then gives a uniform, not NaN, softmax
# Query block of `causal_attention`: 8 blocks at T = 2048 execute 56 % of the dense scores; smaller
# blocks save little more and unroll more, smaller matmuls.
ATTN_BLOCK = 256


def rope_tables(
    positions: jax.Array, rotary_dim: int, theta: float, dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, T, rotary_dim]` for integer positions `[B, T]` (HF's rotate-half layout), in
    `dtype` or float32, whichever is wider (float32 as `transformers` computes them)."""
    dtype = compute_dtype(jnp.dtype(dtype))
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim))
    freqs = positions.astype(dtype)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, rotary_dim]
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first `rotary_dim` features of each head; x `[B, T, H, D]`, cos/sin `[B, T, R]`."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x_rot * c + rotated * s, x_pass], axis=-1)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    heads_first: bool = False,
    probs_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Causal grouped-query attention.

    q `[B, T, Hq, D]`; k, v `[B, S, Hkv, D]` (`[B, Hkv, S, D]` with `heads_first`, the decode
    cache's layout); positions `[B, T]` / `[B, S]` decide causality (a key is visible when its
    position ≤ the query's); optional segment ids forbid attention across packed sequences;
    `kv_valid` `[B, S]` marks filled cache slots. The probabilities are rounded to `probs_dtype`
    (default v's dtype) before they weight v. Returns `[B, T, Hq, D]`.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1 if heads_first else 2]
    kv = "bkud" if heads_first else "bukd"
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]: query heads grouped by their kv head
    with jax.named_scope("scores"):
        s = jnp.einsum(f"btkgd,{kv}->bkgtu", qg, k, preferred_element_type=compute_dtype(q))
        s = s * (d**-0.5)
    with jax.named_scope("mask"):
        mask = kv_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
        if q_segments is not None and kv_segments is not None:
            mask &= q_segments[:, :, None] == kv_segments[:, None, :]
        if kv_valid is not None:
            mask &= kv_valid[:, None, :]
        s = jnp.where(mask[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(probs_dtype or v.dtype)
    o = jnp.einsum(f"bkgtu,{kv}->btkgd", p, v)
    return o.reshape(b, t, hq, d)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segments: jax.Array | None = None,
    block: int | None = None,
) -> jax.Array:
    """Causal grouped-query self-attention in query blocks (q, k, v of the same tokens).

    q `[B, T, Hq, D]`; k, v `[B, T, Hkv, D]`; `segments` `[B, T]` forbids attention across packed
    sequences. Token t sees token u when u ≤ t (by index) and both are in the same segment: the
    mask of `attention` for positions that increase within each segment (what the model passes
    without a cache), where the two give the same result. Returns `[B, T, Hq, D]`.

    Block i (queries [lo, hi)) takes the scores of keys [0, hi) only; every row sees at least its
    own token, so no row is fully masked. Autodiff of each block is as blocked as its forward.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    c = min(block or ATTN_BLOCK, t)
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]: query heads grouped by their kv head
    # the query blocks by `lax.split`, whose transpose is one concatenate of the blocks' gradients;
    # slices would transpose to a zero-padded full-length array per block, all summed (on an H200
    # at T = 8192 that sum of 32 padded arrays was a 2.7 ms fusion per attention layer)
    starts = list(range(0, t, c))
    q_blocks = jax.lax.split(qg, [min(lo + c, t) - lo for lo in starts], axis=1)
    outs = []
    for lo, q_block in zip(starts, q_blocks, strict=True):
        hi = min(lo + c, t)
        kb, vb = k[:, :hi], v[:, :hi]  # the keys this block can see
        with jax.named_scope("scores"):
            s = jnp.einsum("btkgd,bukd->bkgtu", q_block, kb, preferred_element_type=compute_dtype(q))
            s = s * (d**-0.5)  # [B, Hkv, G, hi - lo, hi]
        with jax.named_scope("mask"):
            # A numpy constant: token lo + i sees keys ≤ lo + i.
            mask = jnp.asarray(np.arange(hi)[None, :] <= np.arange(lo, hi)[:, None])  # [hi - lo, hi]
            if segments is not None:
                mask = mask & (segments[:, lo:hi, None] == segments[:, None, :hi])  # [B, hi - lo, hi]
                mask = mask[:, None, None]
            s = jnp.where(mask, s, _NEG)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgtu,bukd->btkgd", p, vb))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return o.reshape(b, t, hq, d)
