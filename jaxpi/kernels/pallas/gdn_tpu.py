"""The gated delta rule's chunk recurrence for TPU (Mosaic): one chunk per grid step.

Grid (batch, head, chunk) with the chunk axis sequential ("arbitrary"): each step's blocks are one
chunk's tiles ([C, K], [C, Dv], [C, C]; Dv whole, as Mosaic tiles lanes by 128), so VMEM holds one
chunk at a time whatever T is, and Pallas' pipeline prefetches the next chunk while this one
computes. The state (forward) or its cotangent (backward) lives in a VMEM scratch [K, Dv] carried
across the chunk steps; the backward walks the chunks in reverse through its index maps. The decay
and its gradient travel as [N, B, H, K, 1] columns (the last two block axes must be whole or
(8, 128)-aligned).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpi.kernels.pallas.gdn_chunk import backward_chunk, forward_chunk, mm

f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
# batch and head programs are independent; the chunk steps carry the state
_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _forward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, s0_ref, out_ref, final_ref, *rest, precision
):  # fmt: skip
    """One chunk: u [C,V], w/qr/kw [C,K], p [C,C], d [K,1]; s0/final [K,V]; (states [K,V]), scratch S [K,V]."""
    *states_ref, s_scr = rest
    n = pl.program_id(2)

    # the scratch outlives the grid step: load the initial state once per (batch, head)
    @pl.when(n == 0)
    def _() -> None:
        s_scr[...] = s0_ref[...]

    s = s_scr[...]
    if states_ref:
        states_ref[0][...] = s
    out_ref[...], s = forward_chunk(
        u_ref[...], w_ref[...], qr_ref[...], p_ref[...], kw_ref[...], d_ref[...], s, precision
    )
    s_scr[...] = s

    # final's block index is the same at every chunk step, so it is written back once, after the last
    @pl.when(n == pl.num_programs(2) - 1)
    def _() -> None:
        final_ref[...] = s


def _backward_kernel(
    u_ref, w_ref, qr_ref, p_ref, kw_ref, d_ref, states_ref, dout_ref, dfinal_ref,
    du_ref, dw_ref, dqr_ref, dp_ref, dkw_ref, dd_ref, ds0_ref, ds_scr, *, precision,
):  # fmt: skip
    """Step i is chunk N−1−i (the index maps reverse the order); scratch dS [K,V] carries dS'."""
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _() -> None:
        ds_scr[...] = dfinal_ref[...]

    ds, s = ds_scr[...], states_ref[...]
    tiles = (u_ref[...], w_ref[...], qr_ref[...], p_ref[...], kw_ref[...], d_ref[...])
    grads, ds_prev = backward_chunk(*tiles, s, dout_ref[...], ds, precision)
    du_ref[...], dw_ref[...], dqr_ref[...], dp_ref[...], dkw_ref[...] = grads
    dd_ref[...] = jnp.sum(s * ds, axis=1, keepdims=True)  # [K, 1]
    ds_scr[...] = ds_prev

    @pl.when(i == pl.num_programs(2) - 1)
    def _() -> None:
        ds0_ref[...] = ds_prev


def _chunk_spec(rows: int, cols: int, num_chunks: int, *, reverse: bool) -> pl.BlockSpec:
    """One chunk's [rows, cols] tile of an [N, B, H, rows, cols] array at grid step (b, h, i)."""
    # the backward reverses through the index map, so the pipeline prefetches in walking order
    if reverse:
        return pl.BlockSpec((None, None, None, rows, cols), lambda b, h, i: (num_chunks - 1 - i, b, h, 0, 0))
    return pl.BlockSpec((None, None, None, rows, cols), lambda b, h, i: (i, b, h, 0, 0))


def _state_spec(dk: int, dv: int) -> pl.BlockSpec:
    """The [K, V] state of (b, h), the same block at every chunk step (read first / written last)."""
    return pl.BlockSpec((None, None, dk, dv), lambda b, h, i: (b, h, 0, 0))


def tpu_forward(
    chunks: tuple[jax.Array, ...],
    s0: jax.Array,
    *,
    precision: jax.lax.Precision,
    save_states: bool,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """(out [N,B,H,C,V], final [B,H,K,V], and states [N,B,H,K,V] if save_states)."""
    u, w, qr, p, kw, d = chunks
    n, b, h, c, dv = u.shape
    dk = w.shape[-1]
    spec = functools.partial(_chunk_spec, num_chunks=n, reverse=False)
    in_specs = [
        spec(c, dv),
        spec(c, dk),
        spec(c, dk),
        spec(c, c),
        spec(c, dk),
        spec(dk, 1),
        _state_spec(dk, dv),
    ]
    out_shape = [f32(u.shape), f32(s0.shape)] + ([f32((n, b, h, dk, dv))] if save_states else [])
    out_specs = [spec(c, dv), _state_spec(dk, dv)] + ([spec(dk, dv)] if save_states else [])
    call = pl.pallas_call(
        functools.partial(_forward_kernel, precision=precision),
        grid=(b, h, n),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=_SEMANTICS,
        interpret=pltpu.InterpretParams() if interpret else False,
        name="forward_kernel",
    )
    # [K, 1] columns: a scalar per chunk would need SMEM and scalar prefetch; a column scales S's rows
    d_col = jnp.broadcast_to(d[..., None, None], (n, b, h, dk, 1))
    return tuple(call(u, w, qr, p, kw, d_col, s0))


def tpu_backward(
    chunks: tuple[jax.Array, ...],
    states: jax.Array,
    dout: jax.Array,
    dfinal: jax.Array,
    *,
    precision: jax.lax.Precision,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """(dU, dW, dQ_r, dP, dK_w, dd [N,B,H], dS₀), each like its forward input."""
    u, w, qr, p, kw, d = chunks
    n, b, h, c, dv = u.shape
    dk = w.shape[-1]
    spec = functools.partial(_chunk_spec, num_chunks=n, reverse=True)
    in_specs = [spec(c, dv), spec(c, dk), spec(c, dk), spec(c, c), spec(c, dk), spec(dk, 1)]
    in_specs += [spec(dk, dv), spec(c, dv), _state_spec(dk, dv)]
    out_shape = [f32(x.shape) for x in (u, w, qr, p, kw)] + [f32((n, b, h, dk, 1)), f32(dfinal.shape)]
    out_specs = [
        spec(c, dv),
        spec(c, dk),
        spec(c, dk),
        spec(c, c),
        spec(c, dk),
        spec(dk, 1),
        _state_spec(dk, dv),
    ]
    call = pl.pallas_call(
        functools.partial(_backward_kernel, precision=precision),
        grid=(b, h, n),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=_SEMANTICS,
        interpret=pltpu.InterpretParams() if interpret else False,
        name="backward_kernel",
    )
    d_col = jnp.broadcast_to(d[..., None, None], (n, b, h, dk, 1))
    *grads, dd, ds0 = call(u, w, qr, p, kw, d_col, states, dout, dfinal)
    return (*grads, dd.sum(axis=(-2, -1)), ds0)  # dd: [N, B, H, K, 1] -> [N, B, H]


# ---- the split scan's recurrence (`gdn_chunked.split_chunk_scan`) -------------------------------


def _recurrence_kernel(a_ref, b_ref, u_ref, d_ref, *rest, precision):
    """One step: a/b [C,K], u [C,V], d [K,1], (r [K,V]); x0/final [K,V]; xs [K,V]; scratch X [K,V].

    xs = X; X ← d ⊙_row X + Bᵀ (U − A X) (+ R). The index maps give the chunk order.
    """
    *r_ref, x0_ref, xs_ref, final_ref, x_scr = rest
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _() -> None:
        x_scr[...] = x0_ref[...]

    x = x_scr[...]
    xs_ref[...] = x
    y = u_ref[...] - mm(a_ref[...], x, "nn", precision)
    x = d_ref[...] * x + mm(b_ref[...], y, "tn", precision)
    if r_ref:
        x = x + r_ref[0][...]
    x_scr[...] = x

    @pl.when(i == pl.num_programs(2) - 1)
    def _() -> None:
        final_ref[...] = x


def tpu_recurrence(
    a: jax.Array,
    b: jax.Array,
    u: jax.Array,
    d: jax.Array,
    r: jax.Array | None,
    x0: jax.Array,
    *,
    reverse: bool,
    precision: jax.lax.Precision,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """`gdn_chunked.linear_recurrence` with one chunk per grid step and the carry in VMEM."""
    n, bsz, h, c, dv = u.shape
    dk = a.shape[-1]
    spec = functools.partial(_chunk_spec, num_chunks=n, reverse=reverse)
    in_specs = [spec(c, dk), spec(c, dk), spec(c, dv), spec(dk, 1)]
    in_specs += ([] if r is None else [spec(dk, dv)]) + [_state_spec(dk, dv)]
    call = pl.pallas_call(
        functools.partial(_recurrence_kernel, precision=precision),
        grid=(bsz, h, n),
        in_specs=in_specs,
        out_specs=[spec(dk, dv), _state_spec(dk, dv)],
        out_shape=[f32((n, bsz, h, dk, dv)), f32(x0.shape)],
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=_SEMANTICS,
        interpret=pltpu.InterpretParams() if interpret else False,
        name="recurrence_kernel",
    )
    d_col = jnp.broadcast_to(d[..., None, None], (n, bsz, h, dk, 1))
    xs, final = call(a, b, u, d_col, *([] if r is None else [r]), x0)
    return xs, final
