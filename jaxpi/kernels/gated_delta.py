"""The gated delta rule (Gated DeltaNet), chunked for training and token-by-token for decoding.

Per value head, with state S ∈ R^{Dk×Dv}, decay g_t ≤ 0 and learning rate β_t ∈ (0, 1):

    q_t ← q_t / ‖q_t‖ · Dk^-½,   k_t ← k_t / ‖k_t‖            (the L2 norms are optional)
    u_t = β_t (v_t − e^{g_t} S_{t-1}ᵀ k_t)                      (the delta: what the state mispredicts)
    S_t = e^{g_t} S_{t-1} + k_t u_tᵀ
    o_t = S_tᵀ q_t

Packed sequences: where segment_ids changes (t > 0), S_{t-1} is replaced by 0, so every segment
sees only itself; the initial state belongs to the first segment.

The chunked form, for training, and the algorithms it shares with the Pallas kernels are in
`gdn_chunked`; this module holds the token-by-token forms and `chunk_gated_delta_rule`, which
picks the chunk scan (plain JAX from `gdn_chunked`, Pallas from `jaxpi.kernels.pallas`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpi.axes import current_resolver
from jaxpi.config import GDN_IMPLS
from jaxpi.kernels.cpu import rows
from jaxpi.kernels.dtypes import compute_dtype, upcast
from jaxpi.kernels.gdn_chunked import (
    _chunk_scan,
    _chunk_scan_assoc,
    _initial_state,
    _prepare_qk,
    _segment_resets,
    chunked_gated_delta_rule_with,
    split_chunk_scan,
)

# ---- token by token ----------------------------------------------------------------------------


def _delta_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token on prepared float32 inputs: state [B,H,K,V], q/k [B,H,K], v [B,H,V], g/beta [B,H].

    Two passes over the state, where the equations as written take four or more: one read for both
    Sᵀk and Sᵀq, then one read and one write for the update, since the output needs no S_t:

        S_tᵀ q = e^g Sᵀq + (kᵀq) u,   u = β (v − e^g Sᵀk)
    """
    decay = jnp.exp(g)[..., None]  # [B, H, 1]
    with jax.named_scope("state_reads"):
        kq = jnp.stack([k, q], axis=-2)  # [B, H, 2, K]
        sk, sq = jnp.moveaxis(jnp.einsum("bhkv,bhjk->bhjv", state, kq), -2, 0)  # 2 × [B, H, V]
    delta = beta[..., None] * (v - decay * sk)
    out = decay * sq + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    with jax.named_scope("state_update"):
        state = decay[..., None] * state + k[..., :, None] * delta[..., None, :]
    return out, state


def gated_delta_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    use_qk_l2norm: bool = True,
    active: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode token: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dk, Dv].

    active [B] bool or None: a row outside it keeps its state, exactly (g = 0 and β = 0 make the
    update 1·S + k·0), so the caller needs no select over the whole state afterwards.
    Returns (output [B, Hv, Dv] in v's dtype, new state float32).
    """
    q, k = _prepare_qk(q, k, v.shape[-2], use_qk_l2norm)
    v32, g32, beta32 = (upcast(x) for x in (v, g, beta))
    if active is not None:
        g32, beta32 = (jnp.where(active[:, None], x, 0.0) for x in (g32, beta32))
    state = state.astype(compute_dtype(state, v))
    native = state.dtype == jnp.float32 and q.dtype == jnp.float32 and current_resolver() is None
    if native and rows.delta_available():  # one native call per layer (the CPU, AVX-512)
        out, state = rows.delta_step(state, q, k, v32, g32, beta32)
    else:
        out, state = _delta_step(state, q, k, v32, g32, beta32)
    return out.astype(v.dtype), state


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence one token at a time (a `lax.scan` over T); same contract as the chunked form."""
    batch, length, num_v_heads, _ = v.shape
    with jax.named_scope("l2norm_and_scale"):
        qp, kp = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    resets = _segment_resets(segment_ids, batch, length)

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        reset, *token = xs
        state = jnp.where(reset[:, None, None, None], 0.0, state)
        out, state = _delta_step(state, *token)
        return state, out

    tokens = (qp, kp, *(upcast(x) for x in (v, g, beta)))
    xs = [jnp.moveaxis(x, 1, 0) for x in (resets, *tokens)]  # scan wants time leading: [T, B, ...]
    with jax.named_scope("token_scan"):
        state, out = jax.lax.scan(step, _initial_state(initial_state, v, kp.shape[-1]), xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state


IMPLS = GDN_IMPLS


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = True,
    impl: str = "jax",
    kernel: dict | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, chunk by chunk (see `gdn_chunked`'s docstring).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None
    (zeros); segment_ids [B, T] ints or None. Any T: padded inside to a multiple of chunk_size.
    impl: "jax" (plain JAX, a sequential scan over the chunks: the reference and the CPU path),
    "jax_assoc" (plain JAX, the chunks composed in log depth: `_chunk_scan_assoc`), "jax_split"
    (plain JAX, a state-only recurrence and chunk-parallel products with an explicit backward:
    `split_chunk_scan`), "pallas" (the chunk recurrence as Pallas kernels, `jaxpi.kernels.pallas`:
    compiled on GPU/TPU, interpreted on CPU) or "pallas_split" (`split_chunk_scan` with its two
    recurrences as a Pallas kernel). `kernel`: the Pallas paths' settings (`KernelOptions` fields
    but interpret, e.g. {"block_v": 16}; `jaxpi.config.parse_gdn_kernel`), refused for the others.
    Returns (output [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] float32).
    """
    kwargs = dict(
        chunk_size=chunk_size,
        initial_state=initial_state,
        segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm,
    )
    if kernel and not impl.startswith("pallas"):
        raise ValueError(f"kernel settings {kernel} apply only to impl pallas / pallas_split, not {impl!r}")
    if impl == "jax":
        return chunked_gated_delta_rule_with(_chunk_scan, q, k, v, g, beta, **kwargs)
    if impl == "jax_assoc":
        return chunked_gated_delta_rule_with(_chunk_scan_assoc, q, k, v, g, beta, **kwargs)
    if impl == "jax_split":
        return chunked_gated_delta_rule_with(split_chunk_scan(), q, k, v, g, beta, **kwargs)
    if impl in ("pallas", "pallas_split"):
        # imported here: the Pallas kernels are only traced when asked for
        from jaxpi.kernels.pallas import pallas_chunk_gated_delta_rule

        return pallas_chunk_gated_delta_rule(
            q, k, v, g, beta, split=impl == "pallas_split", **kwargs, **(kernel or {})
        )
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
