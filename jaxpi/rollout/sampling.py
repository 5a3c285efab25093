"""Temperature / nucleus sampling and per-token log-probabilities, as pure functions over logits.

For logits ℓ [B, V] (upcast to float32 if narrower; float64 stays float64):

    raw      = log_softmax(ℓ)                          what the trainer recomputes (temperature 1)
    scaled   = ℓ / T
    keep_v   = mass of tokens strictly more likely than v < top_p   (the nucleus; ties kept)
               (every token when top_p = 1)
    proc     = log_softmax(scaled masked to the nucleus)
    token    = argmax ℓ                  if T = 0
             = categorical(key_b, proc)  otherwise

Each row has its own key, so a row's draw does not depend on which other rows share the batch.

The nucleus sorts each row's vocabulary, which on the CPU cost more than the model's own step
(9 ms at batch 1, 164 ms at batch 16 for a 32k vocabulary: docs/performance.md, "Decode at the
bandwidth limit"). So `sample_tokens` branches on the scalars (`lax.cond`: only the chosen
branch runs): greedy neither sorts nor draws, and top_p = 1 draws from the whole softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _widen(logits: jax.Array) -> jax.Array:
    """bf16/fp16 logits to float32; float32 and float64 unchanged (float64 for numerical checks)."""
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def nucleus_logprobs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Log-probabilities `[B, V]` of the processed distribution (temperature > 0)."""
    scaled = _widen(logits) / jnp.maximum(temperature, 1e-6)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    desc = -jnp.sort(-logp, axis=-1)  # [B, V], most likely first
    # Probability mass of the tokens before each one in sorted order; the first is always kept.
    before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)
    n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # [B, 1], >= 1
    cutoff = jnp.take_along_axis(desc, n_keep - 1, axis=-1)  # least likely kept log-prob
    # Compare log-probs (not ranks) so that tokens tied at the cutoff are all kept. At top_p = 1
    # every token is: the float32 running sum can reach 1 before the tail and would cut it.
    keep = (logp >= cutoff) | (top_p >= 1.0)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def first_argmax(logits: jax.Array) -> jax.Array:
    """`argmax` over the last axis (the first index of the largest value, as `jnp.argmax`) from
    two plain reductions: XLA:CPU's fused (value, index) reduction of `jnp.argmax` took 2.4 ms
    for [16, 32768] float32 where these take 0.35 ms (13.5 and 2.7 ms at 64 rows)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)


def sample_tokens(
    keys: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row. Returns `(tokens [B] int32, raw_logprob [B], sampling_logprob [B])`.

    `keys` holds one PRNG key per row; `temperature` 0 selects the argmax (sampling log-prob 0).
    `temperature` and `top_p` are scalars, so one branch serves the whole batch.
    """
    logits = _widen(logits)
    at = lambda lp, tokens: jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]  # noqa: E731

    def greedy() -> tuple[jax.Array, jax.Array]:
        tokens = first_argmax(logits)
        return tokens, jnp.zeros(tokens.shape, logits.dtype)

    def draw() -> tuple[jax.Array, jax.Array]:
        proc = jax.lax.cond(
            top_p >= 1.0,
            lambda: jax.nn.log_softmax(logits / jnp.maximum(temperature, 1e-6), axis=-1),
            lambda: nucleus_logprobs(logits, temperature, top_p),
        )
        tokens = jax.vmap(jax.random.categorical)(keys, proc).astype(jnp.int32)
        return tokens, at(proc, tokens)

    tokens, proc = jax.lax.cond(temperature <= 0.0, greedy, draw)
    return tokens, at(jax.nn.log_softmax(logits, axis=-1), tokens), proc
