"""The chunk recurrence of the gated delta rule as Pallas kernels (forward and backward).

`pallas_chunk_gated_delta_rule` has the contract of `gated_delta.chunk_gated_delta_rule` and shares
all of its plain-JAX preparation: the L2 norm and scale of q/k, the head repeat, padding T to the
chunk, the segment masks, and the intra-chunk terms U, W, ρe^γ⊙Q, P, ε e^{γ_{C-1}−γ}⊙K and
ρ_{C-1}e^{γ_{C-1}} (including T = (I + A)⁻¹ by block doubling, see that module's docstring). Those
are independent per chunk, batched matmuls that XLA already runs well; autodiff differentiates them.
What the kernels replace is the sequential part, the `lax.scan` over chunks, which XLA runs as one
small-matmul step per chunk with the state round-tripping through memory. Per chunk n, with the
state S [Dk, Dv] entering it:

    Δ   = U − W S                                   [C, Dv]
    O   = Q_r S + P Δ                               [C, Dv]
    S'  = d ⊙_row S + K_wᵀ Δ                        d [Dk]: the chunk-end decay on every key row

Forward kernel: one program per (batch, head, block of Dv columns), the chunk loop inside
(`fori_loop`), S held on chip for the whole sequence. The Dv columns never mix (every product
above multiplies S or Δ from the left), so splitting Dv into `block_v` columns is exact and gives
B·H·Dv/block_v programs. It writes O, the final state and, when a backward pass will follow, the
state entering every chunk [N, B, H, Dk, Dv] (the chunk-boundary states).

Backward kernel: the same grid, the chunk loop reversed, carrying dS (the cotangent of the state
leaving chunk n). Per chunk, from the saved S and Δ recomputed as U − W S:

    dΔ  = Pᵀ dO + K_w dS'          dU = dΔ          dP  = dO Δᵀ        dQ_r = dO Sᵀ
    dK_w = Δ dS'ᵀ                  dW = −dΔ Sᵀ       dd  = Σ_v S ⊙ dS'
    dS  = d ⊙_row dS' + Q_rᵀ dO − Wᵀ dΔ

dP, dQ_r, dK_w, dW and dd sum over Dv, so each Dv block writes its partial sums and they are
added outside ([Dv/block_v, ...] → sum). Memory: the saved boundary states cost N·Dk·Dv floats per
head (2·T·Dv at Dk = 128, C = 64: twice v) and buy a backward that needs no second forward scan;
within a chunk Δ is recomputed (one [C, Dk]·[Dk, block_v] matmul) rather than stored.

Platforms: compiled through Triton on GPU (`pallas_call` with `plt.CompilerParams`) and through
Mosaic on TPU. On TPU Dv is taken whole (Mosaic tiles lanes by 128) and each program's blocks span
the whole sequence: at T = 2048, Dk = Dv = 128 that is ~15 MiB of VMEM double-buffered for the
forward and ~24 MiB for the backward, growing with T, so long sequences on TPU need the chunk axis
as a sequential grid axis with the state in VMEM scratch (not written: the TPU variant is lowered
in the tests, never compiled or run). On CPU the same kernels run in Pallas' interpreter, which
checks semantics only (its timings say nothing about the hardware). `interpret=None` chooses per
platform at lowering time (`lax.platform_dependent`), so one jitted function serves every backend;
`interpret=True` forces the interpreter everywhere. Matmuls run at full float32 precision by
default (IEEE on Triton, no TF32) to stay within the parity tolerances of the plain-JAX path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpi.kernels.gated_delta import chunked_gated_delta_rule_with

# "highest": IEEE float32 products (the parity setting); "tf32": Triton's TF32 tensor-core dots
# (10-bit mantissa), what XLA may pick for the plain-JAX path's fp32 dots on NVIDIA GPUs (and on
# TPU, Mosaic's default-precision fp32 matmul)
_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "tf32": jax.lax.Precision.DEFAULT}
_CONTRACT = {"nn": ((1,), (0,)), "tn": ((0,), (0,)), "nt": ((1,), (1,))}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernels run. `block_v`: Dv columns per program (None: min(Dv, 32)), a divisor of Dv;
    on GPU a power of two ≥ 16, as must be the chunk size and Dk (Triton's tile rule; the Triton
    lowering names the offending shape); on TPU always Dv. `interpret`: None = interpret
    on CPU, compile on GPU/TPU; True = interpret everywhere; False = compile only (no CPU lowering).
    `precision`: the in-kernel fp32 matmuls, "highest" (IEEE fp32) or "tf32" (lax's DEFAULT: TF32 on
    Triton, Mosaic's default bf16 passes on TPU; the CPU interpreter computes fp32 either way).
    `num_warps` / `num_stages`: Triton launch parameters (not tuned on hardware yet)."""

    block_v: int | None = None
    interpret: bool | None = None
    precision: str = "highest"
    num_warps: int = 4
    # one stage: each chunk loads ~120 KiB (forward) / ~144 KiB (backward) of fp32 tiles at
    # Dk = 128, C = 64, block_v = 32, so double-buffering them may not fit 227 KiB of shared memory
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.block_v is not None and self.block_v < 1:
            raise ValueError(f"block_v must be >= 1, got {self.block_v}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(
                f"num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}"
            )
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(_PRECISIONS)}, got {self.precision!r}")

    def resolve_block_v(self, dv: int, mode: str) -> int:
        """Columns per program for one mode; Mosaic tiles lanes by 128, so on TPU the whole Dv."""
        if mode == "mosaic":
            return dv
        block = min(dv, 32) if self.block_v is None else self.block_v
        if dv % block:
            raise ValueError(f"block_v ({block}) must divide the value head dim ({dv})")
        return block


def _mm(a: jax.Array, b: jax.Array, form: str, precision: jax.lax.Precision) -> jax.Array:
    """2-D matmul, float32 accumulation: "nn" a·b, "tn" aᵀ·b, "nt" a·bᵀ (the forms Triton's dot takes)."""
    return jax.lax.dot_general(
        a, b, (_CONTRACT[form], ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


# ---- kernels (refs are one (batch, head, Dv-block) program's view; chunk index n leads) ----------


def _forward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, s0_ref, out_ref, final_ref, *states_ref, precision
):  # fmt: skip
    """u [N,C,bv], w/qr/kw [N,C,K], p [N,C,C], d [N,K], s0 [K,bv] -> out [N,C,bv], final [K,bv] (+ states [N,K,bv])."""
    mm = functools.partial(_mm, precision=precision)

    def chunk(n: jax.Array, s: jax.Array) -> jax.Array:
        if states_ref:
            states_ref[0][n] = s
        delta = u_ref[n] - mm(w_ref[n], s, "nn")  # [C, bv]
        out_ref[n] = mm(qr_ref[n], s, "nn") + mm(p_ref[n], delta, "nn")
        return d_ref[n][:, None] * s + mm(kw_ref[n], delta, "tn")

    final_ref[...] = jax.lax.fori_loop(0, u_ref.shape[0], chunk, s0_ref[...])


def _backward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, states_ref, dout_ref, dfinal_ref,
    du_ref, dw_ref, dqr_ref, dp_ref, dkw_ref, dd_ref, ds0_ref, *, precision,
):  # fmt: skip
    """Reverse chunk loop carrying dS [K,bv]; the d{w,qr,p,kw,d} outputs are this Dv block's partial sums."""
    num_chunks = u_ref.shape[0]
    mm = functools.partial(_mm, precision=precision)

    def chunk(i: jax.Array, ds: jax.Array) -> jax.Array:
        n = num_chunks - 1 - i
        s, w, qr, kw, dout = states_ref[n], w_ref[n], qr_ref[n], kw_ref[n], dout_ref[n]
        delta = u_ref[n] - mm(w, s, "nn")  # recomputed, not saved
        ddelta = mm(p_ref[n], dout, "tn") + mm(kw, ds, "nn")  # [C, bv]
        du_ref[n] = ddelta
        dw_ref[n] = -mm(ddelta, s, "nt")
        dqr_ref[n] = mm(dout, s, "nt")
        dp_ref[n] = mm(dout, delta, "nt")
        dkw_ref[n] = mm(delta, ds, "nt")
        dd_ref[n] = jnp.sum(s * ds, axis=1)
        return d_ref[n][:, None] * ds + mm(qr, dout, "tn") - mm(w, ddelta, "tn")

    ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...])


# ---- pallas_call wiring ------------------------------------------------------------------------


def _specs(shape: tuple[int, ...], block_v: int, *, v_cols: bool, partial: bool = False) -> pl.BlockSpec:
    """BlockSpec for a [N, B, H, R, X] chunk array (or [B, H, K, V] state when N is absent).

    v_cols: the last axis is Dv, split in block_v columns; else taken whole. partial: an extra
    leading axis of Dv blocks (the backward's per-block partial sums).
    """
    *lead, rows, cols = shape
    block_last = block_v if v_cols else cols
    last = (lambda j: j) if v_cols else (lambda j: 0)
    if len(lead) == 2:  # a state [B, H, K, V]
        return pl.BlockSpec((None, None, rows, block_last), lambda b, h, j: (b, h, 0, last(j)))
    if partial:
        n = lead[1]
        return pl.BlockSpec((None, n, None, None, rows, block_last), lambda b, h, j: (j, 0, b, h, 0, last(j)))
    n = lead[0]
    return pl.BlockSpec((n, None, None, rows, block_last), lambda b, h, j: (0, b, h, 0, last(j)))


def _decay_spec(n: int, dk: int, *, partial: bool = False) -> pl.BlockSpec:
    """BlockSpec for the decay rows [B, H, N, K] (N next to K: Mosaic tiles the last two axes)."""
    if partial:
        return pl.BlockSpec((None, None, None, n, dk), lambda b, h, j: (j, b, h, 0, 0))
    return pl.BlockSpec((None, None, n, dk), lambda b, h, j: (b, h, 0, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, opts: KernelOptions, mode: str):
    """`pallas_call` for one mode: "interpret" (CPU), "triton" (GPU) or "mosaic" (TPU)."""
    params = (
        plt.CompilerParams(num_warps=opts.num_warps, num_stages=opts.num_stages) if mode == "triton" else None
    )
    return pl.pallas_call(
        functools.partial(kernel, precision=_PRECISIONS[opts.precision]),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=mode == "interpret",
        compiler_params=params,
        name=kernel.__name__.strip("_"),
    )


def _per_platform(fn, opts: KernelOptions, *args: jax.Array):
    """fn(mode)(*args), the mode chosen at lowering time unless `interpret` forces it."""
    if opts.interpret is True:
        return fn("interpret")(*args)
    if opts.interpret is False:
        return jax.lax.platform_dependent(*args, cuda=fn("triton"), rocm=fn("triton"), tpu=fn("mosaic"))
    return jax.lax.platform_dependent(
        *args, cpu=fn("interpret"), cuda=fn("triton"), rocm=fn("triton"), tpu=fn("mosaic")
    )


def _forward(chunks: tuple[jax.Array, ...], s0: jax.Array, opts: KernelOptions, save_states: bool):
    u, w, qr, p, kw, d = chunks  # [N,B,H,C,V], [N,B,H,C,K] ×2, [N,B,H,C,C], [N,B,H,C,K], [B,H,N,K]
    n, b, h, _, dv = u.shape
    dk = w.shape[-1]
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    out_shape = [f32(u.shape), f32(s0.shape)] + ([f32((n, b, h, dk, dv))] if save_states else [])

    def build(mode: str):
        bv = opts.resolve_block_v(dv, mode)
        in_specs = [
            _specs(u.shape, bv, v_cols=True),
            *(_specs(x.shape, bv, v_cols=False) for x in (w, qr, p, kw)),
            _decay_spec(n, dk),
            _specs(s0.shape, bv, v_cols=True),
        ]
        out_specs = [_specs(u.shape, bv, v_cols=True), _specs(s0.shape, bv, v_cols=True)]
        out_specs += [_specs((n, b, h, dk, dv), bv, v_cols=True)] if save_states else []
        return _call(_forward_kernel, (b, h, dv // bv), in_specs, out_specs, out_shape, opts, mode)

    return _per_platform(build, opts, u, w, qr, p, kw, d, s0)


def _backward(chunks, states, dout, dfinal, opts: KernelOptions):
    u, w, qr, p, kw, d = chunks
    n, b, h, _, dv = u.shape
    dk = w.shape[-1]
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)

    def build(mode: str):
        bv = opts.resolve_block_v(dv, mode)
        nv = dv // bv
        in_specs = [
            _specs(u.shape, bv, v_cols=True),
            *(_specs(x.shape, bv, v_cols=False) for x in (w, qr, p, kw)),
            _decay_spec(n, dk),
            *(_specs(x.shape, bv, v_cols=True) for x in (states, dout, dfinal)),
        ]
        partials = [(nv, *x.shape) for x in (w, qr, p, kw)]
        out_shape = [f32(u.shape), *(f32(s) for s in partials), f32((nv, b, h, n, dk)), f32(dfinal.shape)]
        out_specs = [
            _specs(u.shape, bv, v_cols=True),
            *(_specs(s, bv, v_cols=False, partial=True) for s in partials),
            _decay_spec(n, dk, partial=True),
            _specs(dfinal.shape, bv, v_cols=True),
        ]
        call = _call(_backward_kernel, (b, h, nv), in_specs, out_specs, out_shape, opts, mode)

        def summed(*args: jax.Array) -> tuple[jax.Array, ...]:
            # partial sums over the Dv blocks; dd also over the key rows (one decay per chunk)
            du, dw, dqr, dp, dkw, dd, ds0 = call(*args)
            dd = jnp.moveaxis(dd.sum(axis=(0, -1)), -1, 0)  # [B, H, N] -> [N, B, H]
            return (du, *(x.sum(axis=0) for x in (dw, dqr, dp, dkw)), dd, ds0)

        return summed

    return _per_platform(build, opts, u, w, qr, p, kw, d, states, dout, dfinal)


# ---- custom_vjp ----------------------------------------------------------------------------------


def _kernel_chunks(chunks: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The end decay [N,B,H] as per-key-row vectors [B,H,N,K] (what the kernels load per chunk)."""
    *rest, d = chunks
    d = jnp.moveaxis(d, 0, -1)  # [N, B, H] -> [B, H, N]
    return (*rest, jnp.broadcast_to(d[..., None], (*d.shape, rest[1].shape[-1])))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pallas_chunk_scan(
    chunks: tuple[jax.Array, ...], state: jax.Array, opts: KernelOptions
) -> tuple[jax.Array, jax.Array]:
    """Drop-in for `gated_delta._chunk_scan`: (state [B,H,K,V], out [N,B,H,C,V])."""
    out, final = _forward(_kernel_chunks(chunks), state, opts, save_states=False)
    return final, out


def _scan_fwd(chunks, state, opts):
    kchunks = _kernel_chunks(chunks)
    out, final, states = _forward(kchunks, state, opts, save_states=True)
    return (final, out), (kchunks, states)


def _scan_bwd(opts, residuals, cotangents):
    kchunks, states = residuals
    dfinal, dout = cotangents
    *dchunks, ds0 = _backward(kchunks, states, dout, dfinal, opts)
    return tuple(dchunks), ds0


pallas_chunk_scan.defvjp(_scan_fwd, _scan_bwd)


def pallas_chunk_gated_delta_rule(
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
    block_v: int | None = None,
    interpret: bool | None = None,
    precision: str = "highest",
    num_warps: int = 4,
    num_stages: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """`chunk_gated_delta_rule` with the chunk recurrence in Pallas; same arguments and results.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None;
    segment_ids [B, T] or None. The other keywords: see `KernelOptions`.
    Returns (output [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] float32).
    """
    opts = KernelOptions(
        block_v=block_v, interpret=interpret, precision=precision, num_warps=num_warps, num_stages=num_stages
    )
    return chunked_gated_delta_rule_with(
        lambda chunks, state: pallas_chunk_scan(chunks, state, opts),
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        initial_state=initial_state,
        segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm,
    )
