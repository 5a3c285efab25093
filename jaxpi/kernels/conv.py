"""Depthwise causal conv over time (the Gated DeltaNet's short conv), for prefill and decode alike.

With window w = concat(state, x) along time (state = the K−1 inputs before x) and weight [K, C]:

    y_{t,c} = Σ_{k<K} weight_{k,c} · w_{t+k,c}      (tap K−1 is the current token x_t)
    out     = silu(y) if activation else y

Packed sequences: a tap whose input lies in another segment than token t reads 0 instead; the
incoming state belongs to the first segment. The new state is the last K−1 entries of w, with
entries from segments before the last one zeroed, so decoding continues the last segment alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.kernels import inject
from jaxpi.kernels.dtypes import upcast


def _segment_runs(segment_ids: jax.Array, num_state: int) -> jax.Array:
    """[B, K−1+T]: a run number per window position, equal exactly within a segment (state = run 0)."""
    starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))  # [B, T]
    return jnp.pad(jnp.cumsum(starts, axis=1), ((0, 0), (num_state, 0)))


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    state: jax.Array | None = None,
    activation: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C], weight [K, C] (transformers' conv1d.weight[:, 0, :] transposed), segment_ids [B, T],
    state [B, K−1, C] (zeros if None). Returns (output [B, T, C] in x's dtype, new state [B, K−1, C]).
    """
    batch, length, channels = x.shape
    num_taps = weight.shape[0]
    if state is None:
        state = jnp.zeros((batch, num_taps - 1, channels), x.dtype)
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K−1+T, C]
    taps = jnp.stack([window[:, i : i + length] for i in range(num_taps)], axis=2)  # [B, T, K, C]
    new_state = window[:, length:]
    if segment_ids is not None:
        runs = _segment_runs(segment_ids, num_taps - 1)
        tap_runs = jnp.stack([runs[:, i : i + length] for i in range(num_taps)], axis=2)  # [B, T, K]
        taps = jnp.where((tap_runs == runs[:, -length:, None])[..., None], taps, 0)
        new_state = jnp.where((runs[:, length:] == runs[:, -1:])[..., None], new_state, 0)
    taps, weight = upcast(taps), upcast(weight)
    if inject.active() == "conv-short-chunk-dw":
        y = inject.backward_of(_conv_taps, _conv_taps_short_chunk_dw)(taps, weight)
    else:
        y = _conv_taps(taps, weight)
    if activation:
        y = jax.nn.silu(y)
    return y.astype(x.dtype), new_state


# Tokens per partial sum of the weight gradient (see `_conv_taps`).
DW_BLOCK = 256


@jax.custom_vjp
def _conv_taps(taps: jax.Array, weight: jax.Array) -> jax.Array:
    """y_{b,t,c} = Σ_k taps_{b,t,k,c} · weight_{k,c}, with the weight gradient summed in two levels.

    dW_{k,c} = Σ_{b,t} taps_{b,t,k,c} · dy_{b,t,c} is a sum over every token: one long float32
    contraction's rounding grows with B·T (measured against float64 at [2, 4096, 144]: 1.5e-6,
    3.5× transformers' conv1d). Summing blocks of DW_BLOCK tokens first and the blocks' partial
    sums after keeps both levels short (the same terms; 0.4e-6 there).
    """
    return jnp.einsum("btkc,kc->btc", taps, weight)


def _conv_taps_fwd(taps: jax.Array, weight: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _conv_taps(taps, weight), (taps, weight)


def _conv_taps_bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    taps, weight = res
    dtaps = jnp.einsum("btc,kc->btkc", dy, weight)
    rows, (num_taps, channels) = taps.shape[0] * taps.shape[1], taps.shape[2:]
    block = min(DW_BLOCK, rows)
    pad = -rows % block
    t = jnp.pad(taps.reshape(rows, num_taps, channels), ((0, pad), (0, 0), (0, 0)))
    d = jnp.pad(dy.reshape(rows, channels), ((0, pad), (0, 0)))
    partial = jnp.einsum(  # [blocks, K, C]
        "nskc,nsc->nkc", t.reshape(-1, block, num_taps, channels), d.reshape(-1, block, channels)
    )
    return dtaps, jnp.sum(partial, axis=0).astype(weight.dtype)


_conv_taps.defvjp(_conv_taps_fwd, _conv_taps_bwd)


def _conv_taps_short_chunk_dw(taps: jax.Array, weight: jax.Array) -> jax.Array:
    """The injected bug "conv-short-chunk-dw", as a function whose VJP is the buggy one: dx is
    right; dW reads each token's taps from its own block of c = K − 2 tokens and the block before
    only, so with blocks shorter than the window minus one the taps that reach further are lost."""
    length, num_taps = taps.shape[1], taps.shape[2]
    block = max(1, num_taps - 2)
    lag = num_taps - 1 - np.arange(num_taps)  # tap k reads token t − lag_k
    offset = np.arange(length) % block
    seen = jnp.asarray(lag[None, :] <= offset[:, None] + block, taps.dtype)  # [T, K]
    stop = jax.lax.stop_gradient
    return _conv_taps(taps, stop(weight)) + _conv_taps(stop(taps) * seen[None, :, :, None], weight)
