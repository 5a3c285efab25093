"""The gated delta rule's chunk recurrence for GPU (Triton) and Pallas' generic interpreter.

Grid (batch, head, Dv / block_v): one program per block of Dv columns, the chunk loop inside
(`fori_loop`) with the state on chip for the whole sequence. Each program sees its whole sequence
of chunks ([N, C, ...] refs; Triton loads one [C, ...] tile per chunk), so nothing is staged in
on-chip memory beyond the tiles of the chunk at hand. The backward writes per-Dv-block partial
sums of the products that contract Dv; they are added here, outside the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpi.kernels.pallas.gdn_chunk import backward_chunk, forward_chunk, mm

f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)


def _forward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, s0_ref, out_ref, final_ref, *states_ref, precision
):  # fmt: skip
    """u [N,C,bv], w/qr/kw [N,C,K], p [N,C,C], d [N,K], s0 [K,bv] -> out [N,C,bv], final [K,bv] (+ states [N,K,bv])."""

    def chunk(n: jax.Array, s: jax.Array) -> jax.Array:
        if states_ref:  # only when a backward follows: the forward alone keeps no residuals
            states_ref[0][n] = s
        # one [C, ...] tile per input and chunk: the loads are strided views of the chunk arrays
        tiles = (u_ref[n], w_ref[n], qr_ref[n], p_ref[n], kw_ref[n], d_ref[n][:, None])
        out_ref[n], s = forward_chunk(*tiles, s, precision)
        return s

    final_ref[...] = jax.lax.fori_loop(0, u_ref.shape[0], chunk, s0_ref[...])


def _backward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, states_ref, dout_ref, dfinal_ref,
    du_ref, dw_ref, dqr_ref, dp_ref, dkw_ref, dd_ref, ds0_ref, *, precision,
):  # fmt: skip
    """Reverse chunk loop carrying dS [K,bv]; the d{w,qr,p,kw,d} outputs are this Dv block's partial sums."""
    num_chunks = u_ref.shape[0]

    def chunk(i: jax.Array, ds: jax.Array) -> jax.Array:
        n = num_chunks - 1 - i
        s = states_ref[n]  # saved by the forward: no second forward scan to rebuild it
        tiles = (u_ref[n], w_ref[n], qr_ref[n], p_ref[n], kw_ref[n], d_ref[n][:, None])
        grads, ds_prev = backward_chunk(*tiles, s, dout_ref[n], ds, precision)
        du_ref[n], dw_ref[n], dqr_ref[n], dp_ref[n], dkw_ref[n] = grads
        dd_ref[n] = jnp.sum(s * ds, axis=1)  # dd = Σ_v S ⊙ dS', per key row
        return ds_prev

    ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...])


def _spec(shape: tuple[int, ...], block_v: int, *, v_cols: bool, partial: bool = False) -> pl.BlockSpec:
    """BlockSpec for a [N, B, H, R, X] chunk array (or [B, H, K, V] state when N is absent).

    v_cols: the last axis is Dv, split in block_v columns; else taken whole. partial: an extra
    leading axis of Dv blocks (the backward's per-block partial sums).
    """
    *lead, rows, cols = shape
    # the whole sequence of chunks per program: the chunk loop runs inside the kernel
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
    """BlockSpec for the decay rows [B, H, N, K]."""
    if partial:
        return pl.BlockSpec((None, None, None, n, dk), lambda b, h, j: (j, b, h, 0, 0))
    return pl.BlockSpec((None, None, n, dk), lambda b, h, j: (b, h, 0, 0))


def _decay_rows(d: jax.Array, dk: int) -> jax.Array:
    """[N, B, H] -> [B, H, N, K]: the chunk-end decay repeated on every key row."""
    d = jnp.moveaxis(d, 0, -1)
    # a [K] row per chunk rather than a scalar: the kernels load vectors, and the row scales S's rows
    return jnp.broadcast_to(d[..., None], (*d.shape, dk))


def _call(kernel: Callable, grid, in_specs, out_specs, out_shape, *, precision, interpret, params, **static):
    """The kernel as a `pallas_call` named after it; `static`: its other keyword arguments."""
    return pl.pallas_call(
        functools.partial(kernel, precision=precision, **static),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else params,
        name=kernel.__name__.strip("_"),
    )


def gpu_forward(
    chunks: tuple[jax.Array, ...],
    s0: jax.Array,
    *,
    block_v: int,
    precision: jax.lax.Precision,
    save_states: bool,
    interpret: bool,
    params: plt.CompilerParams,
) -> tuple[jax.Array, ...]:
    """(out [N,B,H,C,V], final [B,H,K,V], and states [N,B,H,K,V] if save_states)."""
    u, w, qr, p, kw, d = chunks
    n, b, h, _, dv = u.shape
    dk = w.shape[-1]
    in_specs = [
        _spec(u.shape, block_v, v_cols=True),
        *(_spec(x.shape, block_v, v_cols=False) for x in (w, qr, p, kw)),
        _decay_spec(n, dk),
        _spec(s0.shape, block_v, v_cols=True),
    ]
    out_shape = [f32(u.shape), f32(s0.shape)] + ([f32((n, b, h, dk, dv))] if save_states else [])
    out_specs = [_spec(u.shape, block_v, v_cols=True), _spec(s0.shape, block_v, v_cols=True)]
    out_specs += [_spec((n, b, h, dk, dv), block_v, v_cols=True)] if save_states else []
    call = _call(
        _forward_kernel, (b, h, dv // block_v), in_specs, out_specs, out_shape,
        precision=precision, interpret=interpret, params=params,
    )  # fmt: skip
    return tuple(call(u, w, qr, p, kw, _decay_rows(d, dk), s0))


def gpu_backward(
    chunks: tuple[jax.Array, ...],
    states: jax.Array,
    dout: jax.Array,
    dfinal: jax.Array,
    *,
    block_v: int,
    precision: jax.lax.Precision,
    interpret: bool,
    params: plt.CompilerParams,
) -> tuple[jax.Array, ...]:
    """(dU, dW, dQ_r, dP, dK_w, dd [N,B,H], dS₀), each like its forward input."""
    u, w, qr, p, kw, d = chunks
    n, b, h, _, dv = u.shape
    dk = w.shape[-1]
    nv = dv // block_v
    in_specs = [
        _spec(u.shape, block_v, v_cols=True),
        *(_spec(x.shape, block_v, v_cols=False) for x in (w, qr, p, kw)),
        _decay_spec(n, dk),
        *(_spec(x.shape, block_v, v_cols=True) for x in (states, dout, dfinal)),
    ]
    partials = [(nv, *x.shape) for x in (w, qr, p, kw)]
    out_shape = [f32(u.shape), *(f32(s) for s in partials), f32((nv, b, h, n, dk)), f32(dfinal.shape)]
    out_specs = [
        _spec(u.shape, block_v, v_cols=True),
        *(_spec(s, block_v, v_cols=False, partial=True) for s in partials),
        _decay_spec(n, dk, partial=True),
        _spec(dfinal.shape, block_v, v_cols=True),
    ]
    call = _call(
        _backward_kernel, (b, h, nv), in_specs, out_specs, out_shape,
        precision=precision, interpret=interpret, params=params,
    )  # fmt: skip
    du, dw, dqr, dp, dkw, dd, ds0 = call(u, w, qr, p, kw, _decay_rows(d, dk), states, dout, dfinal)
    # partial sums over the Dv blocks; dd also over the key rows (one decay per chunk)
    dd = jnp.moveaxis(dd.sum(axis=(0, -1)), -1, 0)  # [B, H, N] -> [N, B, H]
    return (du, *(x.sum(axis=0) for x in (dw, dqr, dp, dkw)), dd, ds0)


# ---- the split scan's recurrence (`gdn_chunked.split_chunk_scan`) -------------------------------


def _recurrence_kernel(a_ref, b_ref, u_ref, d_ref, *rest, reverse, precision):
    """a/b [N,C,K], u [N,C,bv], d [N,K], (r [N,K,bv]), x0 [K,bv] -> xs [N,K,bv], final [K,bv].

    Per step: xs[n] = X; X ← d_n ⊙_row X + B_nᵀ (U_n − A_n X) (+ R_n); the steps in reverse if asked.
    """
    *r_ref, x0_ref, xs_ref, final_ref = rest
    num_chunks = u_ref.shape[0]

    def step(i: jax.Array, x: jax.Array) -> jax.Array:
        n = num_chunks - 1 - i if reverse else i
        xs_ref[n] = x
        y = u_ref[n] - mm(a_ref[n], x, "nn", precision)
        x = d_ref[n][:, None] * x + mm(b_ref[n], y, "tn", precision)
        return x + r_ref[0][n] if r_ref else x

    final_ref[...] = jax.lax.fori_loop(0, num_chunks, step, x0_ref[...])


def gpu_recurrence(
    a: jax.Array,
    b: jax.Array,
    u: jax.Array,
    d: jax.Array,
    r: jax.Array | None,
    x0: jax.Array,
    *,
    reverse: bool,
    block_v: int,
    precision: jax.lax.Precision,
    interpret: bool,
    params: plt.CompilerParams,
) -> tuple[jax.Array, jax.Array]:
    """`gdn_chunked.linear_recurrence` as one program per (batch, head, block of Dv columns)."""
    n, bsz, h, _, dv = u.shape
    dk = a.shape[-1]
    state = functools.partial(_spec, block_v=block_v, v_cols=True)
    in_specs = [
        _spec(a.shape, block_v, v_cols=False),
        _spec(b.shape, block_v, v_cols=False),
        state(u.shape),
        _decay_spec(n, dk),
        *([] if r is None else [state(r.shape)]),
        state(x0.shape),
    ]
    out_shape = [f32((n, bsz, h, dk, dv)), f32(x0.shape)]
    call = _call(
        _recurrence_kernel, (bsz, h, dv // block_v), in_specs, [state(s.shape) for s in out_shape], out_shape,
        precision=precision, interpret=interpret, params=params, reverse=reverse,
    )  # fmt: skip
    args = (a, b, u, _decay_rows(d, dk), *([] if r is None else [r]), x0)
    xs, final = call(*args)
    return xs, final
