"""The chunk recurrence of the gated delta rule as Pallas kernels (forward and backward).

This module holds the contract, the options, the per-platform dispatch and the `custom_vjp`; the
kernels are in `gdn_gpu` (Triton, and Pallas' generic interpreter on CPU) and `gdn_tpu` (Mosaic),
one chunk's equations in `gdn_chunk`.

`pallas_chunk_gated_delta_rule` has the contract of `gated_delta.chunk_gated_delta_rule` and shares
all of its plain-JAX preparation (`gdn_chunked`): the L2 norm and scale of q/k, the head repeat,
padding T to the chunk, the segment masks, and the intra-chunk terms U, W, ρe^γ⊙Q, P,
ε e^{γ_{C-1}−γ}⊙K and ρ_{C-1}e^{γ_{C-1}} (including T = (I + A)⁻¹ by block doubling, see that
module's docstring). Those are independent per chunk, batched matmuls that XLA already runs well;
autodiff differentiates them.
What the kernels replace is the sequential part, the `lax.scan` over chunks, which XLA runs as one
small-matmul step per chunk with the state round-tripping through memory. Per chunk n, with the
state S [Dk, Dv] entering it:

    Δ   = U − W S                                   [C, Dv]
    O   = Q_r S + P Δ                               [C, Dv]
    S'  = d ⊙_row S + K_wᵀ Δ                        d [Dk]: the chunk-end decay on every key row

Forward: S stays on chip across the chunks. On GPU one program per (batch, head, block of Dv
columns) loops over the chunks inside (`fori_loop`); the Dv columns never mix (every product above
multiplies S or Δ from the left), so splitting Dv into `block_v` columns is exact and gives
B·H·Dv/block_v programs. On TPU the chunks are a sequential grid axis and S a VMEM scratch. The
forward writes O, the final state and, when a backward pass will follow, the state entering every
chunk [N, B, H, Dk, Dv] (the chunk-boundary states).

Backward: the same layout, the chunks in reverse, carrying dS (the cotangent of the state leaving
chunk n). Per chunk, from the saved S and Δ recomputed as U − W S:

    dΔ  = Pᵀ dO + K_w dS'          dU = dΔ          dP  = dO Δᵀ        dQ_r = dO Sᵀ
    dK_w = Δ dS'ᵀ                  dW = −dΔ Sᵀ       dd  = Σ_v S ⊙ dS'
    dS  = d ⊙_row dS' + Q_rᵀ dO − Wᵀ dΔ

dP, dQ_r, dK_w, dW and dd sum over Dv, so on GPU each Dv block writes its partial sums and they
are added outside ([Dv/block_v, ...] → sum). Memory: the saved boundary states cost N·Dk·Dv floats per
head (2·T·Dv at Dk = 128, C = 64: twice v) and buy a backward that needs no second forward scan;
within a chunk Δ is recomputed (one [C, Dk]·[Dk, block_v] matmul) rather than stored.

Platforms: `interpret=None` chooses per platform at lowering time (`lax.platform_dependent`), so one
jitted function serves every backend: Triton on GPU (`plt.CompilerParams`), Mosaic on TPU, Pallas'
interpreter running the GPU kernels on CPU. `interpret=True` forces that interpreter everywhere and
`interpret="tpu"` runs the TPU kernels in Pallas' TPU interpreter (on CPU: how the tests check
them). Interpreted timings say nothing about the hardware. The in-kernel float32 matmuls follow
JAX's default matmul precision, as the plain-JAX path's dots do: lax's DEFAULT (TF32 tensor-core
dots on Triton, as XLA runs the plain path's float32 dots on an NVIDIA GPU) unless
`jax.default_matmul_precision` says otherwise (the parity harness asks for "highest"). On the H200 at the 27B layer shapes the IEEE
float32 setting ("highest", CUDA-core FMAs) was 11–15× slower than TF32 (forward 59.2 vs 3.55 ms);
the CPU interpreter computes float32 either way, so the parity tests hold for both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.experimental.pallas import triton as plt

from jaxpi.kernels.gdn_chunked import Recurrence, chunked_gated_delta_rule_with, split_chunk_scan
from jaxpi.kernels.pallas.dispatch import per_platform
from jaxpi.kernels.pallas.gdn_gpu import gpu_backward, gpu_forward, gpu_recurrence
from jaxpi.kernels.pallas.gdn_tpu import tpu_backward, tpu_forward, tpu_recurrence
from jaxpi.kernels.pallas.sharded import sharded_gated_delta_rule

# "default": whatever `jax.default_matmul_precision` is at trace time (lax's DEFAULT unless set),
# like every plain-JAX dot; "tf32": lax's DEFAULT whatever that setting, i.e. Triton's TF32
# tensor-core dots (10-bit mantissa), what XLA picks for the plain path's fp32 dots on NVIDIA GPUs
# (and on TPU, Mosaic's default-precision fp32 matmul); "highest": IEEE float32 products
_PRECISIONS = {
    "default": None,
    "tf32": jax.lax.Precision.DEFAULT,
    "highest": jax.lax.Precision.HIGHEST,
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernels run. `block_v`: Dv columns per GPU program (None: min(Dv, 32)), a divisor of
    Dv; on GPU a power of two ≥ 16, as must be the chunk size and Dk (Triton's tile rule; the Triton
    lowering names the offending shape); TPU programs take Dv whole. `interpret`: None = interpret
    on CPU, compile on GPU/TPU; True = the generic interpreter everywhere; "tpu" = the TPU kernels in
    Pallas' TPU interpreter; False = compile only (no CPU lowering).
    `precision`: the in-kernel fp32 matmuls, "default" (JAX's default matmul precision at trace
    time, as for any plain-JAX dot), "tf32" (lax's DEFAULT whatever that setting: TF32 on Triton,
    Mosaic's default bf16 passes on TPU) or "highest" (IEEE fp32: CUDA-core FMAs on Triton, 11–15×
    slower on the H200); the CPU interpreter computes fp32 either way.
    `num_warps` / `num_stages`: Triton launch parameters. On the H200 (27B layer shapes, TF32)
    the defaults (block_v 32, 4 warps, 1 stage) were the fastest of the five settings timed:
    forward 3.55 ms, forward + backward 15.0 ms; block_v 64: 4.71 / 15.1; 8 warps: 4.72 / 17.3;
    2 stages: 4.46 / 18.1; block_v 16 with 2 stages: 4.86 / 21.1 (docs/performance.md)."""

    block_v: int | None = None
    interpret: bool | str | None = None
    precision: str = "default"
    num_warps: int = 4
    # one stage: each chunk loads ~120 KiB (forward) / ~144 KiB (backward) of fp32 tiles at
    # Dk = 128, C = 64, block_v = 32, so double-buffering them may not fit 227 KiB of shared memory
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.block_v is not None and self.block_v < 1:
            raise ValueError(f"block_v must be >= 1, got {self.block_v}")
        if self.interpret not in (None, True, False, "tpu"):
            raise ValueError(f"interpret must be None, True, False or 'tpu', got {self.interpret!r}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(
                f"num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}"
            )
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(_PRECISIONS)}, got {self.precision!r}")

    def resolve_block_v(self, dv: int) -> int:
        block = min(dv, 32) if self.block_v is None else self.block_v
        if dv % block:
            raise ValueError(f"block_v ({block}) must divide the value head dim ({dv})")
        return block


def _forward(chunks: tuple[jax.Array, ...], s0: jax.Array, opts: KernelOptions, save_states: bool):
    precision = _PRECISIONS[opts.precision]
    params = plt.CompilerParams(num_warps=opts.num_warps, num_stages=opts.num_stages)

    def build(mode: str) -> Callable:
        if mode.startswith("mosaic"):
            kw = dict(precision=precision, save_states=save_states, interpret=mode == "mosaic_interpret")
            return lambda *a: tpu_forward(a[:-1], a[-1], **kw)
        block_v = opts.resolve_block_v(s0.shape[-1])
        kw = dict(block_v=block_v, precision=precision, save_states=save_states, params=params)
        return lambda *a: gpu_forward(a[:-1], a[-1], interpret=mode == "interpret", **kw)

    return per_platform(build, opts.interpret, *chunks, s0)


def _backward(chunks, states, dout, dfinal, opts: KernelOptions):
    precision = _PRECISIONS[opts.precision]
    params = plt.CompilerParams(num_warps=opts.num_warps, num_stages=opts.num_stages)

    def build(mode: str) -> Callable:
        if mode.startswith("mosaic"):
            kw = dict(precision=precision, interpret=mode == "mosaic_interpret")
            return lambda *a: tpu_backward(a[:6], *a[6:], **kw)
        kw = dict(block_v=opts.resolve_block_v(dfinal.shape[-1]), precision=precision, params=params)
        return lambda *a: gpu_backward(a[:6], *a[6:], interpret=mode == "interpret", **kw)

    return per_platform(build, opts.interpret, *chunks, states, dout, dfinal)


def pallas_recurrence(opts: KernelOptions) -> Recurrence:
    """`gdn_chunked.linear_recurrence` as a Pallas kernel (both passes of `split_chunk_scan`)."""
    precision = _PRECISIONS[opts.precision]
    params = plt.CompilerParams(num_warps=opts.num_warps, num_stages=opts.num_stages)

    def recurrence(a, b, u, d, r, x0, *, reverse: bool):
        def build(mode: str) -> Callable:
            def run(*args):
                a, b, u, d, *r, x0 = args
                rest = (r[0] if r else None, x0)
                if mode.startswith("mosaic"):
                    kw = dict(precision=precision, interpret=mode == "mosaic_interpret")
                    return tpu_recurrence(a, b, u, d, *rest, reverse=reverse, **kw)
                kw = dict(block_v=opts.resolve_block_v(x0.shape[-1]), precision=precision, params=params)
                return gpu_recurrence(a, b, u, d, *rest, reverse=reverse, interpret=mode == "interpret", **kw)

            return run

        args = (a, b, u, d) + (() if r is None else (r,)) + (x0,)
        return per_platform(build, opts.interpret, *args)

    return recurrence


# ---- custom_vjp ----------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pallas_chunk_scan(
    chunks: tuple[jax.Array, ...], state: jax.Array, opts: KernelOptions
) -> tuple[jax.Array, jax.Array]:
    """Drop-in for `gdn_chunked._chunk_scan`: (state [B,H,K,V], out [N,B,H,C,V])."""
    out, final = _forward(chunks, state, opts, save_states=False)
    return final, out


def _scan_fwd(chunks, state, opts):
    out, final, states = _forward(chunks, state, opts, save_states=True)
    return (final, out), (chunks, states)


def _scan_bwd(opts, residuals, cotangents):
    chunks, states = residuals
    dfinal, dout = cotangents
    *dchunks, ds0 = _backward(chunks, states, dout, dfinal, opts)
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
    interpret: bool | str | None = None,
    precision: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`chunk_gated_delta_rule` with the chunk recurrence in Pallas; same arguments and results.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None;
    segment_ids [B, T] or None. `split`: False runs the whole chunk scan in the kernels (this
    module's docstring); True runs `gdn_chunked.split_chunk_scan` with its two state recurrences as
    the kernel `pallas_recurrence` (2 matmuls per sequential step, the rest chunk-parallel in XLA).
    The other keywords: see `KernelOptions` (None: its default). Traced under a mesh (an
    activation resolver installed), the whole rule runs per (batch, value head) shard in
    `jax.shard_map` (`jaxpi.kernels.pallas.sharded`).
    Returns (output [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] float32).
    """
    given = dict(block_v=block_v, precision=precision, num_warps=num_warps, num_stages=num_stages)
    opts = KernelOptions(interpret=interpret, **{k: x for k, x in given.items() if x is not None})

    def scan(chunks: tuple[jax.Array, ...], state: jax.Array) -> tuple[jax.Array, jax.Array]:
        if split:
            return split_chunk_scan(pallas_recurrence(opts))(chunks, state)
        return pallas_chunk_scan(chunks, state, opts)

    def rule(q, k, v, g, beta, initial_state, segment_ids):
        return chunked_gated_delta_rule_with(
            scan,
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

    # under a mesh: once per (batch, value head) shard inside shard_map (see `sharded`)
    return sharded_gated_delta_rule(rule, q, k, v, g, beta, initial_state, segment_ids)
