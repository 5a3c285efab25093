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


def _segment_runs(segment_ids: jax.Array, num_state: int) -> jax.Array:
    """[B, K−1+T]: a run number per window position, equal exactly within a segment (state = run 0)."""
    starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))  # [B, T]
    return jnp.pad(jnp.cumsum(starts, axis=1), ((0, 0), (num_state, 0)))


@jax.custom_vjp
def _weighted_taps(taps: tuple[jax.Array, ...], weight: jax.Array) -> jax.Array:
    """Σ_k taps[k] · weight[k] (float32 [B, T, C] each, weight [K, C]), elementwise.

    The K products summed elementwise are one fusion forward and, for the taps, backward: a stack
    of the taps [B, T, K, C] contracted by einsum (what this replaced) was a batched dot that
    XLA:GPU ran with transposes and copies of the whole stack, and that XLA:CPU ran 20x slower
    than this sum. The weight's gradient (full fine-tuning; LoRA leaves the conv frozen and XLA
    drops it) is that contraction, Σ_bt taps ⊗ dy: XLA:CPU runs it as a dot faster than the K
    column reductions autodiff of the sum gives (mid shapes, 2 cores: forward + weight gradient
    90 against 220 ms).
    """
    y = taps[0] * weight[0]
    for k in range(1, len(taps)):
        y = y + taps[k] * weight[k]
    return y


def _weighted_taps_fwd(taps, weight):
    return _weighted_taps(taps, weight), (taps, weight)


def _weighted_taps_bwd(residuals, dy):
    taps, weight = residuals
    dweight = jnp.einsum("kbtc,btc->kc", jnp.stack(taps), dy)
    return tuple(dy * weight[k] for k in range(len(taps))), dweight


_weighted_taps.defvjp(_weighted_taps_fwd, _weighted_taps_bwd)


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
    new_state = window[:, length:]
    runs = None
    if segment_ids is not None:
        runs = _segment_runs(segment_ids, num_taps - 1)
        new_state = jnp.where((runs[:, length:] == runs[:, -1:])[..., None], new_state, 0)
    taps = []
    for i in range(num_taps):
        tap = window[:, i : i + length].astype(jnp.float32)  # [B, T, C]: input t + i − (K−1)
        if runs is not None:
            tap = jnp.where((runs[:, i : i + length] == runs[:, -length:])[..., None], tap, 0)
        taps.append(tap)
    y = _weighted_taps(tuple(taps), weight.astype(jnp.float32))
    if activation:
        y = jax.nn.silu(y)
    return y.astype(x.dtype), new_state
