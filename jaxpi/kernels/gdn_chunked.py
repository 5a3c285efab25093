"""The chunked gated delta rule: the algorithms the plain-JAX path and the Pallas kernels share.

The recurrence is written down in `gated_delta`, whose `chunk_gated_delta_rule` picks the chunk
scan: `_chunk_scan`, `_chunk_scan_assoc` or `split_chunk_scan` from here, or the Pallas kernels of
`jaxpi.kernels.pallas`, which replace only the sequential part and share everything else here.

Chunked form (the chunks of C tokens are independent given the state S entering them). Inside a
chunk, with positions i, j ∈ [0, C):

    γ_i    = Σ_{t≤i} g_t                                         (cumulative log decay)
    ρ_i    = [no reset in [0, i]]                                (the carried-in S reaches i)
    σ_ij   = [j ≤ i and i, j in the same segment]
    ε_j    = [j in the segment of the chunk's last token]       (j feeds the chunk-end state)
    A_ij   = [j < i] σ_ij β_i (k_i·k_j) e^{γ_i−γ_j}             (strictly lower triangular)
    T      = (I + A)⁻¹
    U      = T (β ⊙ V)                                          (the deltas if S were 0)
    W      = T (β ρ e^{γ} ⊙ K)                                  (how S feeds into the deltas)
    P_ij   = σ_ij (q_i·k_j) e^{γ_i−γ_j}

and then, sequentially over chunks (a `lax.scan`):

    Δ  = U − W S                                                (the true deltas u_i)
    O  = (ρ e^{γ} ⊙ Q) S + P Δ
    S' = ρ_{C-1} e^{γ_{C-1}} S + Σ_j ε_j e^{γ_{C-1}−γ_j} k_j Δ_jᵀ

Each e^{γ_i−γ_j} is taken from the sum Σ_{j<t≤i} g_t itself, not from γ_i − γ_j: with fast decays
γ reaches hundreds within a chunk, and the difference of two float32 prefix sums is then off by
~|γ|·2⁻²⁴ (3e-5 at |γ| = 300) exactly where the factor is not small.
The equations for U and W come from writing the recurrence for all u_i of a chunk at once:
(I + A) Δ = β ⊙ V − (β ρ e^{γ} ⊙ K) S. T is inverted with matmuls only (no LAPACK triangular
solve, which hangs inside larger jitted programs on CPU): recursive block doubling, see
`_unit_lower_inverse`. Every exponent above is ≤ 0, and padding tokens (g = 0, β = 0) leave the
state untouched, so the final state is the state after the last real token.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.kernels import inject
from jaxpi.kernels.dtypes import compute_dtype, upcast

_L2_EPS = 1e-6


def _l2norm_value(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


@jax.custom_vjp
def _l2norm_missing_inv_norm(x: jax.Array) -> jax.Array:
    """The injected bug "l2norm-no-inv-norm": the right values, dx = dy − x̂ (x̂·dy) without the
    1/‖x‖ of the true dx = (dy − x̂ (x̂·dy)) / ‖x‖."""
    return _l2norm_value(x)


def _l2_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _l2norm_value(x), x


def _l2_bwd(x: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    xh = _l2norm_value(x)
    return (dy - xh * jnp.sum(xh * dy, axis=-1, keepdims=True),)


_l2norm_missing_inv_norm.defvjp(_l2_fwd, _l2_bwd)


def _l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(‖x‖² + eps), with transformers' eps inside the root (a zero vector stays zero)."""
    if inject.active() == "l2norm-no-inv-norm":
        return _l2norm_missing_inv_norm(x)
    return _l2norm_value(x)


@jax.custom_vjp
def _exp_pre_exp_grad(x: jax.Array) -> jax.Array:
    """The injected bug "gate-grad-pre-exp": exp(x), differentiated as if d exp(x) = x dx."""
    return jnp.exp(x)


_exp_pre_exp_grad.defvjp(lambda x: (jnp.exp(x), x), lambda x, ct: (ct * jnp.where(jnp.isfinite(x), x, 0.0),))


def _decay_exp(x: jax.Array) -> jax.Array:
    return _exp_pre_exp_grad(x) if inject.active() == "gate-grad-pre-exp" else jnp.exp(x)


def _prepare_qk(
    q: jax.Array, k: jax.Array, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[jax.Array, jax.Array]:
    """Float32, optionally L2-normalised, q scaled by Dk^-½, key heads repeated to the value heads.

    The head axis is -2 in both the sequence ([B, T, H, D]) and single-token ([B, H, D]) layouts.
    """
    num_k_heads = k.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    q, k = upcast(q), upcast(k)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // num_k_heads
    # value head h reads key head h // group, as transformers' repeat_interleave
    return jnp.repeat(q, group, axis=-2), jnp.repeat(k, group, axis=-2)


def _initial_state(initial_state: jax.Array | None, v: jax.Array, dk: int) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((v.shape[0], v.shape[-2], dk, v.shape[-1]), compute_dtype(v))
    return initial_state.astype(compute_dtype(initial_state, v))


def _segment_resets(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, T] bool: True where the state restarts from zero (a segment starts at t > 0)."""
    if segment_ids is None:
        return jnp.zeros((batch, length), bool)
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0)))


# ---- chunked -----------------------------------------------------------------------------------


@jax.custom_vjp
def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """T = (I + A)⁻¹ for A [..., C, C] strictly lower triangular (`_block_doubling_inverse`), with
    the inverse's own backward dA = −Tᵀ dT Tᵀ (two matmuls; only A's strictly lower part is
    read by the caller). Autodiff through the doubling steps computes the same product in log₂C
    rounded stages: with correlated keys and β ≈ 1, where I + A is ill-conditioned, its decay
    gradient was 2× further from float64 than transformers' (kernel-level, keys 0.99 correlated:
    dg 2.17e-5 against 1.19e-5; now 1.21e-5), and the backward is ~5% faster on this CPU.
    """
    return _block_doubling_inverse(a)


def _uli_fwd(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    t = _block_doubling_inverse(a)
    return t, t


def _uli_bwd(t: jax.Array, dt: jax.Array) -> tuple[jax.Array]:
    return (-jnp.einsum("...ji,...jk,...lk->...il", t, dt, t),)


_unit_lower_inverse.defvjp(_uli_fwd, _uli_bwd)


def _block_doubling_inverse(a: jax.Array) -> jax.Array:
    """(I + A)⁻¹ for A [..., C, C] strictly lower triangular, with matmuls only.

    Recursive block doubling: with T_b the inverse restricted to its diagonal b×b blocks, each pair
    of neighbouring blocks merges as

        [[I + A11, 0], [A21, I + A22]]⁻¹ = [[T11, 0], [−T22 A21 T11, T22]]

    which is blocked forward substitution, so the rounding error stays at the level of a
    triangular solve. (The Neumann product (I − A)(I + A²)(I + A⁴)… needs no blocks but its
    partial products grow like binomials when keys are correlated: ~25% error at C = 64 in float32.)
    C that is not a power of two is padded with an identity block.
    """
    size = a.shape[-1]
    padded = 1 << (size - 1).bit_length()
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, padded - size)] * 2)
    batch = a.shape[:-2]
    inv = jnp.ones((*batch, padded, 1, 1), a.dtype)  # [..., n, b, b]: the 1×1 diagonal blocks
    b = 1
    while b < padded:
        pairs = padded // (2 * b)
        # [..., C, C] -> [..., pair p, half, i, pair q, half, j]; keep lower-left halves, p == q
        blocks = a.reshape(*batch, pairs, 2, b, pairs, 2, b)[..., :, 1, :, :, 0, :]
        a21 = jnp.einsum("...piqj,pq->...pij", blocks, jnp.eye(pairs, dtype=a.dtype))
        inv = inv.reshape(*batch, pairs, 2, b, b)
        t11, t22 = inv[..., 0, :, :], inv[..., 1, :, :]
        t21 = -jnp.einsum("...pij,...pjk,...pkl->...pil", t22, a21, t11)
        upper = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
        lower = jnp.concatenate([t21, t22], axis=-1)
        inv = jnp.concatenate([upper, lower], axis=-2)  # [..., pairs, 2b, 2b]
        b *= 2
    return inv[..., 0, :size, :size]


def _to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
    """[B, N·C, H, ...] -> [N, B, H, C, ...]: chunks lead for the scan, positions sit next to features."""
    batch, length = x.shape[:2]
    x = x.reshape(batch, length // chunk_size, chunk_size, *x.shape[2:])  # [B, N, C, H, ...]
    return jnp.moveaxis(x, (1, 2), (0, 3))


def _chunk_masks(resets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """From resets [N, B, C]: σ [N, B, 1, C, C], ρ [N, B, 1, C], ε [N, B, 1, C] (broadcast over heads)."""
    size = resets.shape[-1]
    # run r_i = number of resets in [0, i]: positions share a segment exactly when their runs match
    run = jnp.cumsum(resets, axis=-1)[:, :, None]
    causal = jnp.asarray(np.tril(np.ones((size, size), bool)))
    same = causal & (run[..., :, None] == run[..., None, :])
    return same, run == 0, run == run[..., -1:]


def _segment_sums(g: jax.Array) -> jax.Array:
    """[..., C] -> [..., C, C]: entry (i, j) is Σ_{j<t≤i} g_t for j ≤ i (0 on the diagonal), 0 above.

    L · G with L_it = [t ≤ i] and G_tj = g_t·[t > j]: each entry adds only its own terms (the
    others are exact zeros). A float32 matmul at full precision (IEEE on every backend: TF32 would
    keep 10 bits of g), not a cumulative sum: XLA lowers `cumsum` to reduce-windows, and on an H200
    the backward of that form was a 2 ms fusion per DeltaNet layer of the 27B at seq 8192 (94 ms of
    its step, docs/performance.md); on this CPU the matmul is also faster (mid shapes: forward
    2.4 against 4.6 ms, with gradients 10.0 against 11.7 ms).
    """
    size = g.shape[-1]
    below = jnp.asarray(np.tril(np.ones((size, size), bool), -1))
    upto = jnp.asarray(np.tril(np.ones((size, size))), g.dtype)
    terms = jnp.where(below, g[..., :, None], 0.0)
    return jnp.einsum("it,...tj->...ij", upto, terms, precision=jax.lax.Precision.HIGHEST)


def _intra_chunk(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, resets: jax.Array
) -> tuple[jax.Array, ...]:
    """Everything that does not depend on the carried state, for all chunks at once.

    Inputs in chunk layout: q, k [N,B,H,C,K], v [N,B,H,C,V], g, beta [N,B,H,C], resets [N,B,C].
    Returns U, W, ρe^γ⊙Q, P, ε e^{γ_{C-1}−γ}⊙K, ρ_{C-1} e^{γ_{C-1}} (see the module docstring).
    """
    with jax.named_scope("chunk_masks"):
        same, reach, to_end = _chunk_masks(resets)
        strict = same & ~jnp.eye(same.shape[-1], dtype=bool)
    with jax.named_scope("decays"):
        gamma = jnp.cumsum(g, axis=-1)
        seg = _segment_sums(g)  # γ_i − γ_j, summed per pair (see the module docstring)
        # −inf before the exp: above the diagonal the sums are 0, but those pairs must vanish
        pair_decay = _decay_exp(jnp.where(same, seg, -jnp.inf))
        read_decay = jnp.where(reach, jnp.exp(gamma), 0.0)
        write_decay = jnp.where(to_end, jnp.exp(seg[..., -1, :]), 0.0)
    with jax.named_scope("ut_transform"):
        kk = jnp.einsum("nbhik,nbhjk->nbhij", k, k)
        a = jnp.where(strict, beta[..., :, None] * kk * pair_decay, 0.0)
        t = _unit_lower_inverse(a)
        u = jnp.einsum("nbhij,nbhjv->nbhiv", t, beta[..., None] * v)
        w = jnp.einsum("nbhij,nbhjk->nbhik", t, (beta * read_decay)[..., None] * k)
    with jax.named_scope("intra_attention"):
        p = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * pair_decay
    q_read = read_decay[..., None] * q
    k_write = write_decay[..., None] * k
    return u, w, q_read, p, k_write, read_decay[..., -1]


def _chunk_scan(
    chunks: tuple[jax.Array, ...], state: jax.Array, *, unroll: int = 1
) -> tuple[jax.Array, jax.Array]:
    """The sequential part: carry S [B,H,K,V] through the chunks; returns (state, outputs [N,B,H,C,V]).

    `unroll`: chunks per loop iteration (`lax.scan`'s); on the H200 at the 27B layer shapes 8
    made forward + backward 1.19× faster (`jaxpi bench gpu` "jax_unroll8"), not the default.
    """

    def step(state: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u, w, q_read, p, k_write, end_decay = chunk
        delta = u - jnp.einsum("bhik,bhkv->bhiv", w, state)
        out = jnp.einsum("bhik,bhkv->bhiv", q_read, state) + jnp.einsum("bhij,bhjv->bhiv", p, delta)
        state = end_decay[..., None, None] * state + jnp.einsum("bhik,bhiv->bhkv", k_write, delta)
        return state, out

    return jax.lax.scan(step, state, chunks, unroll=unroll)


def _chunk_scan_assoc(chunks: tuple[jax.Array, ...], state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_chunk_scan` in log depth: the chunks' affine maps on S composed by `lax.associative_scan`.

    Each chunk maps the state entering it affinely, S' = M S + R with

        M = ρ_{C-1} e^{γ_{C-1}} I − (ε e^{γ_{C-1}−γ} ⊙ K)ᵀ W     [Dk, Dk]
        R = (ε e^{γ_{C-1}−γ} ⊙ K)ᵀ U                              [Dk, Dv]

    (substitute Δ = U − W S into the sequential update). Maps compose associatively,
    (M₂, R₂) ∘ (M₁, R₁) = (M₂M₁, M₂R₁ + R₂), so the state entering every chunk comes from a prefix
    scan of log₂ N levels of batched matmuls instead of N dependent steps; the outputs then take
    one batched matmul per term for all chunks at once. It does ~4× the sequential scan's FLOPs
    (the Dk×Dk products) to replace N dependent steps (each a handful of small launches on a GPU)
    by 2·log₂N levels. Measured on an H200 at the 27B layer shapes (T 8192, 48 heads, Dk = Dv =
    128): forward 0.76×, forward + backward 1.03× the sequential scan's speed at chunk 64, 0.93× /
    1.24× at chunk 128; in the 27B LoRA step 0.8 % faster for 7 GiB more memory. Not for CPU,
    where the FLOPs are the cost. Same function as `_chunk_scan` up to rounding: the maps are
    products of the per-token transitions e^{g}(I − β k kᵀ), whose norms are ≤ 1.
    """
    u, w, q_read, p, k_write, end_decay = chunks
    eye = jnp.eye(w.shape[-1], dtype=w.dtype)
    m = end_decay[..., None, None] * eye - jnp.einsum("nbhik,nbhil->nbhkl", k_write, w)
    r = jnp.einsum("nbhik,nbhiv->nbhkv", k_write, u)

    def compose(first: tuple[jax.Array, jax.Array], then: tuple[jax.Array, jax.Array]):
        m1, r1 = first
        m2, r2 = then
        return (
            jnp.einsum("...kl,...lm->...km", m2, m1),
            jnp.einsum("...kl,...lv->...kv", m2, r1) + r2,
        )

    with jax.named_scope("compose_maps"):
        m_acc, r_acc = jax.lax.associative_scan(compose, (m, r), axis=0)
    # the state after chunk n, then the state entering each chunk (the initial state first)
    ends = jnp.einsum("nbhkl,bhlv->nbhkv", m_acc, state) + r_acc
    starts = jnp.concatenate([state[None], ends[:-1]], axis=0)
    delta = u - jnp.einsum("nbhik,nbhkv->nbhiv", w, starts)
    out = jnp.einsum("nbhik,nbhkv->nbhiv", q_read, starts) + jnp.einsum("nbhij,nbhjv->nbhiv", p, delta)
    return ends[-1], out


ChunkScan = Callable[[tuple[jax.Array, ...], jax.Array], tuple[jax.Array, jax.Array]]
# recurrence(a, b, u, d, r, x0, reverse) -> (xs, final): see `linear_recurrence`
Recurrence = Callable[..., tuple[jax.Array, jax.Array]]


def linear_recurrence(
    a: jax.Array,
    b: jax.Array,
    u: jax.Array,
    d: jax.Array,
    r: jax.Array | None,
    x0: jax.Array,
    *,
    reverse: bool,
    unroll: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """X ← d_n ⊙ X + B_nᵀ (U_n − A_n X) (+ R_n) over the chunks n, in order or in reverse.

    a, b [N, B, H, C, K]; u [N, B, H, C, V]; d [N, B, H] (a scale of the whole carry per step);
    r [N, B, H, K, V] or None; x0 [B, H, K, V]. Returns (xs [N, B, H, K, V], the carry entering each
    step n, and the carry after the last step). Both passes of the split chunk scan are this
    recurrence (`split_chunk_scan`): two matmuls per step, nothing else sequential. The plain-JAX
    version (a `lax.scan`); `jaxpi.kernels.pallas` has it as a kernel with the same contract.
    """

    def step(x: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        a_, b_, u_, d_, *r_ = chunk
        y = u_ - jnp.einsum("bhik,bhkv->bhiv", a_, x)
        new = d_[..., None, None] * x + jnp.einsum("bhik,bhiv->bhkv", b_, y)
        return (new + r_[0] if r_ else new), x

    xs = (a, b, u, d) + (() if r is None else (r,))
    final, entering = jax.lax.scan(step, x0, xs, reverse=reverse, unroll=unroll)
    return entering, final


def _split_outputs(chunks: tuple[jax.Array, ...], starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Δ, O) for all chunks at once from the state entering each: Δ = U − W S, O = Q_r S + P Δ."""
    u, w, q_read, p, _, _ = chunks
    delta = u - jnp.einsum("nbhik,nbhkv->nbhiv", w, starts)
    out = jnp.einsum("nbhik,nbhkv->nbhiv", q_read, starts) + jnp.einsum("nbhij,nbhjv->nbhiv", p, delta)
    return delta, out


def split_chunk_scan(recurrence: Recurrence = linear_recurrence) -> ChunkScan:
    """`_chunk_scan` split into a state-only recurrence and chunk-parallel products, with its VJP.

    Forward: the states entering the chunks, S_{n+1} = d ⊙ S_n + K_wᵀ (U − W S_n), are the only
    sequential part (`recurrence` with A = W, B = K_w); Δ and O follow for all chunks at once
    (`_split_outputs`). Backward: with dS'_n the cotangent of the state leaving chunk n,

        dS_n = d ⊙ dS'_n + Q_rᵀ dO_n − Wᵀ dΔ_n = d ⊙ dS'_n + Wᵀ (−Pᵀ dO_n − K_w dS'_n) + Q_rᵀ dO_n

    is the same recurrence in reverse (A = K_w, B = W, U = −Pᵀ dO, R = Q_rᵀ dO, both taken for all
    chunks first), and every other cotangent is chunk-parallel once the dS'_n are known:
    dΔ = Pᵀ dO + K_w dS', dU = dΔ, dW = −dΔ Sᵀ, dQ_r = dO Sᵀ, dP = dO Δᵀ, dK_w = Δ dS'ᵀ,
    dd = Σ S ⊙ dS'. The sequential steps do 2 small matmuls each (the fused scan: 4 forward and,
    differentiated, ~9 backward); the price is the states entering the chunks, saved for the
    backward ([N, B, H, Dk, Dv] float32, 2·T·Dv floats per head at Dk = 128, C = 64), and Δ computed
    twice (once inside the recurrence, once outside). This is how fla's Triton kernels split the
    work; `recurrence` is `linear_recurrence` (plain JAX, `impl="jax_split"`) or the Pallas kernel
    (`impl="pallas_split"`).
    """

    def forward(
        chunks: tuple[jax.Array, ...], state: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        u, w, _, _, k_write, end_decay = chunks
        with jax.named_scope("state_recurrence"):
            starts, final = recurrence(w, k_write, u, end_decay, None, state, reverse=False)
        with jax.named_scope("chunk_outputs"):
            out = _split_outputs(chunks, starts)[1]
        return (final, out), starts

    @jax.custom_vjp
    def scan(chunks: tuple[jax.Array, ...], state: jax.Array) -> tuple[jax.Array, jax.Array]:
        return forward(chunks, state)[0]

    def scan_fwd(chunks, state):
        result, starts = forward(chunks, state)
        return result, (chunks, starts)

    def scan_bwd(residuals, cotangents):
        chunks, starts = residuals
        dfinal, dout = cotangents
        _, w, q_read, p, k_write, end_decay = chunks
        pt_dout = jnp.einsum("nbhij,nbhiv->nbhjv", p, dout)  # Pᵀ dO
        with jax.named_scope("state_cotangent_recurrence"):
            r = jnp.einsum("nbhik,nbhiv->nbhkv", q_read, dout)  # Q_rᵀ dO
            # dS'_n for every chunk (the carry entering reverse step n), and dS_0
            dleaving, dstate = recurrence(k_write, w, -pt_dout, end_decay, r, dfinal, reverse=True)
        with jax.named_scope("chunk_cotangents"):
            delta = _split_outputs(chunks, starts)[0]
            ddelta = pt_dout + jnp.einsum("nbhik,nbhkv->nbhiv", k_write, dleaving)
            dchunks = (
                ddelta,
                -jnp.einsum("nbhiv,nbhkv->nbhik", ddelta, starts),
                jnp.einsum("nbhiv,nbhkv->nbhik", dout, starts),
                jnp.einsum("nbhiv,nbhjv->nbhij", dout, delta),
                jnp.einsum("nbhiv,nbhkv->nbhik", delta, dleaving),
                jnp.sum(starts * dleaving, axis=(-2, -1)),
            )
        return dchunks, dstate

    scan.defvjp(scan_fwd, scan_bwd)
    return scan


def chunked_gated_delta_rule_with(
    scan: ChunkScan,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int,
    initial_state: jax.Array | None,
    segment_ids: jax.Array | None,
    use_qk_l2norm: bool,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form with the sequential part supplied: `scan(chunks, state) -> (state, out)`.

    `chunks` are `_intra_chunk`'s outputs (U, W, ρe^γ⊙Q, P, ε e^{γ_{C-1}−γ}⊙K, ρ_{C-1} e^{γ_{C-1}},
    each [N, B, H, ...]); `out` is [N, B, H, C, Dv]. `_chunk_scan` is the plain-JAX scan; the Pallas
    kernels (`jaxpi.kernels.pallas`) replace only this part, so both share every other op.
    """
    batch, length, _, _ = v.shape
    state = _initial_state(initial_state, v, k.shape[-1])
    resets = _segment_resets(segment_ids, batch, length)

    def run(q, k, v, g, beta, state, resets):
        return _chunked(scan, q, k, v, g, beta, state, resets, chunk_size, use_qk_l2norm)

    def late(q, k, v, g, beta, state, resets):  # the injected bug: every reset one token late
        return run(q, k, v, g, beta, state, jnp.pad(resets[:, :-1], ((0, 0), (1, 0))))

    if inject.active() == "segment-reset-off-by-one":
        return inject.backward_of(run, late)(q, k, v, g, beta, state, resets)
    return run(q, k, v, g, beta, state, resets)


def _chunked(
    scan: ChunkScan,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    resets: jax.Array,
    chunk_size: int,
    use_qk_l2norm: bool,
) -> tuple[jax.Array, jax.Array]:
    batch, length, num_v_heads, _ = v.shape
    with jax.named_scope("l2norm_and_scale"):
        qp, kp = _prepare_qk(q, k, num_v_heads, use_qk_l2norm)

    # padding: zero q/k/v, g = 0 (no decay), β = 0 (no write), no reset (continues the last segment)
    pad = -length % chunk_size
    qp, kp, vp = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (qp, kp, upcast(v)))
    gp, betap = (jnp.pad(upcast(x), ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    resets = jnp.pad(resets, ((0, 0), (0, pad)))

    chunks = _intra_chunk(
        *(_to_chunks(x, chunk_size) for x in (qp, kp, vp, gp, betap)),
        jnp.moveaxis(resets.reshape(batch, -1, chunk_size), 1, 0),  # [B, N·C] -> [N, B, C]
    )
    with jax.named_scope("chunk_scan"):
        state, out = scan(chunks, state)
    # [N, B, H, C, V] -> [B, N, C, H, V] -> [B, N·C, H, V]
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(batch, -1, num_v_heads, out.shape[-1])
    return out[:, :length].astype(v.dtype), state
