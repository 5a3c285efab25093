"""Log-probabilities of target tokens through the LM head, a chunk of positions at a time.

    z[b, t]  = hidden[b, t] · W                      [V] logits, in the activation dtype
    lp[b, t] = z[b, t, target[b, t]] − logsumexp(z[b, t])        in ≥ float32

Computed whole, the `[B, T, V]` logits are the largest activation of a training step (27B:
T = 8192, V = 248,320 → 8 GiB in float32, again for their gradient). `target_logprobs` with
`chunk > 0` runs the head over `chunk` positions at a time in a `lax.scan` whose body is
rematerialised: the forward keeps only the `[B, T]` results, and the backward recomputes one
chunk's logits, turns them into that chunk's gradient and drops them, so at most one chunk's
`[B, chunk, V]` logits (and their gradient) exist at once. The FLOPs are those of the whole head
plus one more forward of it (the recomputation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_logprobs(hidden: jax.Array, w: jax.Array, targets: jax.Array) -> jax.Array:
    """`[B, C, D] · [D, V]` → the targets' log-probabilities `[B, C]` in ≥ float32."""
    logits = jnp.einsum("btd,dv->btv", hidden, w)
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def target_logprobs(hidden: jax.Array, w: jax.Array, targets: jax.Array, *, chunk: int = 0) -> jax.Array:
    """`log softmax(hidden · w)[b, t, targets[b, t]]`, `[B, T]` from hidden `[B, T, D]`, w `[D, V]`.

    `chunk = 0` computes all logits at once; `chunk > 0` a chunk of positions at a time (see the
    module docstring); T need not be a multiple of it (the last chunk is padded, its padding
    dropped).
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2] or w.ndim != 2 or w.shape[0] != hidden.shape[2]:
        raise ValueError(
            f"target_logprobs: hidden {hidden.shape}, LM head {w.shape} and targets {targets.shape} "
            "do not fit ([B, T, D], [D, V], [B, T])"
        )
    if chunk < 0:
        raise ValueError(f"target_logprobs: chunk must be >= 0, got {chunk}")
    targets = targets.astype(jnp.int32)
    b, t, d = hidden.shape
    if chunk == 0 or chunk >= t:
        return _chunk_logprobs(hidden, w, targets)
    pad = -t % chunk
    n = (t + pad) // chunk
    # [B, T, ...] → [N, B, C, ...]: chunks lead for the scan
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    body = jax.checkpoint(_chunk_logprobs)  # nothing saved: the backward recomputes the chunk's logits

    def step(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        h, tg = xs
        return carry, body(h, w, tg)

    _, lp = jax.lax.scan(step, None, (hs, ts))  # [N, B, C]
    return lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


def lm_head_weight(model: object) -> jax.Array:
    """The `[D, V]` LM head of a `Qwen3_5ForCausalLM` (the embedding's transpose when tied)."""
    lm_head = getattr(model, "lm_head", None)
    return model.embed[...].T if lm_head is None else lm_head[...]  # type: ignore[attr-defined]
