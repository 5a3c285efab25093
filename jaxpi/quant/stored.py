"""A quantized HF tensor stored as one of jaxpi's projections, and its dequantization in JAX.

jaxpi stores a projection input-major, `W [*in, *out]` (q_proj `[D, H, 2d]`, o_proj `[H, d, D]`),
and bitsandbytes quantizes torch's `[out, in]` flattened row-major. With the input size a multiple
of the block (every projection of the released Qwen3.5 models), each block of 64 lies inside one
output row along the input, so the quantized arrays keep the weight's axes:

    nf4   codes   [*in[:-1], in[-1]/2, *out]  uint8    two input neighbours per byte (high nibble first)
          absmax  [in/64, *out]               uint8    8-bit code of each block's scale
          scale   [ceil(R·in/64/256)]         float32  the second level, of the whole HF tensor
          offset  []                          float32
    int8  codes   [*in, *out]                 int8
          scale   [*out]                      float32  each output row's absmax

`R` is the HF tensor's row count: a part of a fused tensor (`in_proj_qkv` → q, k, v) holds its own
rows of codes and scales but shares the tensor's offset and second level, whose blocks of 256
run across the rows (`Layout.row_start` says where the part's rows begin). An input size that is
not a multiple of 64 (only in toy configs) stores the absmax codes flat, in bitsandbytes' order,
and finds each element's block by its flat index.

`dequantize` rebuilds the weight in the compute dtype from those arrays, with bitsandbytes'
float32 arithmetic; it runs right before the matmul, per layer, inside the scanned groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.quant import check_base_quant, int8, nf4
from jaxpi.quant.codebooks import DYNAMIC, NF4


@dataclasses.dataclass(frozen=True)
class Layout:
    """What `dequantize` needs besides the arrays (static: hashed into the traced program).

    `in_shape`, `out_shape`: one layer's weight `[*in, *out]`; `row_start`: the part's first row
    in its HF tensor; `aligned`: NF4 blocks inside rows (absmax `[in/64, *out]`), else absmax flat
    from block `block_start` on.
    """

    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    row_start: int = 0
    aligned: bool = True
    block_start: int = 0
    blocks: int = 0  # NF4, not aligned: how many blocks are held
    scales: int = 0  # NF4: length of the second level

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.in_shape, *self.out_shape)

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of each stored array of one layer."""
        if self.kind == "int8":
            return {"codes": (self.shape, np.dtype(np.int8)), "scale": (self.out_shape, np.dtype(np.float32))}
        codes = (*self.in_shape[:-1], self.in_shape[-1] // 2, *self.out_shape)
        absmax = (self.in_features // nf4.BLOCK, *self.out_shape) if self.aligned else (self.blocks,)
        return {
            "codes": (codes, np.dtype(np.uint8)),
            "absmax": (absmax, np.dtype(np.uint8)),
            "scale": ((self.scales,), np.dtype(np.float32)),
            "offset": ((), np.dtype(np.float32)),
        }

    def axes(self, weight_axes: tuple[str | None, ...]) -> dict[str, tuple[str | None, ...]]:
        """Logical axes of each stored array, from the weight's (`[*in, *out]`, no `layers`):
        codes keep the weight's, a block axis takes its first input axis' name, the per-tensor
        arrays (second level, offset, flat scales) none (replicated)."""
        n_in = len(self.in_shape)
        out_axes = tuple(weight_axes[n_in:])
        if self.kind == "int8":
            return {"codes": tuple(weight_axes), "scale": out_axes}
        return {
            "codes": tuple(weight_axes),
            "absmax": (weight_axes[0], *out_axes) if self.aligned else (None,),
            "scale": (None,),
            "offset": (),
        }


def layout_for(
    kind: str,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    *,
    rows: tuple[int, int],
    total_rows: int,
) -> Layout:
    """The layout of rows `[r0, r1)` of an HF tensor `[total_rows, prod(in_shape)]` stored as a
    jaxpi weight `[*in_shape, *out_shape]`; raises when NF4 cannot store it."""
    check_base_quant(kind, "base_quant")
    in_shape, out_shape = tuple(int(s) for s in in_shape), tuple(int(s) for s in out_shape)
    r0, r1 = rows
    if r1 - r0 != math.prod(out_shape):
        raise ValueError(f"rows {rows} do not hold the {math.prod(out_shape)} outputs of {out_shape}")
    if kind == "int8":
        return Layout("int8", in_shape, out_shape, row_start=r0)
    n_in = math.prod(in_shape)
    if in_shape[-1] % 2:
        raise ValueError(
            f"nf4 packs input neighbours two per byte: the last input axis ({in_shape[-1]}) must be even"
        )
    if total_rows * n_in >= 2**31:
        raise ValueError(f"nf4: a tensor of {total_rows}×{n_in} exceeds the int32 index range")
    nb_total = -(-total_rows * n_in // nf4.BLOCK)
    scales = -(-nb_total // nf4.SCALE_BLOCK)
    if n_in % nf4.BLOCK == 0:
        return Layout("nf4", in_shape, out_shape, row_start=r0, scales=scales)
    b0, b1 = r0 * n_in // nf4.BLOCK, -(-r1 * n_in // nf4.BLOCK)
    return Layout(
        "nf4", in_shape, out_shape, row_start=r0, aligned=False, block_start=b0, blocks=b1 - b0, scales=scales
    )


def nf4_part(t: nf4.NF4Tensor, layout: Layout) -> dict[str, np.ndarray]:
    """The stored arrays of `layout`'s rows of the quantized HF tensor t (host, one layer)."""
    rows, n_in = t.shape[0], math.prod(t.shape[1:])
    r0, r1 = layout.row_start, layout.row_start + layout.out_features
    codes = t.codes.reshape(rows, n_in // 2)[r0:r1].T  # [in/2, rows]
    shapes = layout.arrays()
    out = {"codes": np.ascontiguousarray(codes).reshape(shapes["codes"][0])}
    if layout.aligned:
        absmax = t.absmax.reshape(rows, n_in // nf4.BLOCK)[r0:r1].T  # [in/64, rows]
        out["absmax"] = np.ascontiguousarray(absmax).reshape(shapes["absmax"][0])
    else:
        out["absmax"] = t.absmax[layout.block_start : layout.block_start + layout.blocks].copy()
    out["scale"] = t.scale.astype(np.float32)
    out["offset"] = np.asarray(t.offset, np.float32)
    return out


def int8_part(t: int8.Int8Tensor, layout: Layout) -> dict[str, np.ndarray]:
    """The stored arrays of `layout`'s rows of the int8 HF tensor t (host, one layer)."""
    r0, r1 = layout.row_start, layout.row_start + layout.out_features
    codes = np.ascontiguousarray(t.codes[r0:r1].T).reshape(layout.shape)
    return {"codes": codes, "scale": np.ascontiguousarray(t.scale[r0:r1]).reshape(layout.out_shape)}


def quantize_rows(kind: str, w: np.ndarray) -> nf4.NF4Tensor | int8.Int8Tensor:
    """Quantize one HF tensor `[out, in]` (values as loaded in the base dtype)."""
    return nf4.quantize(w) if kind == "nf4" else int8.quantize(w)


def part_arrays(t: nf4.NF4Tensor | int8.Int8Tensor, layout: Layout) -> dict[str, np.ndarray]:
    return nf4_part(t, layout) if layout.kind == "nf4" else int8_part(t, layout)


# ---- dequantization in JAX ---------------------------------------------------------------------


def _scales(c8: jax.Array, blk: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """Block absmax `DYNAMIC[c]·s_{b//256} + offset` in float32, rounded twice as bitsandbytes does."""
    prod = jnp.asarray(DYNAMIC)[c8.astype(jnp.int32)] * scale[blk // nf4.SCALE_BLOCK]
    # XLA contracts `a·b + c` into one FMA (one rounding; measured on XLA:CPU: 23% of last bits
    # differ from the two-step result); a select on the product keeps the multiply apart. The
    # product of finite values is never NaN, so the select changes no value.
    prod = jnp.where(prod == prod, prod, 0.0)
    return prod + offset


def dequantize_nf4(arrays: dict[str, jax.Array], layout: Layout, dtype: jnp.dtype) -> jax.Array:
    """ŵ `[*in, *out]` in `dtype` from one layer's NF4 arrays (see the module docstring)."""
    n_in, n_out = layout.in_features, layout.out_features
    lead = len(layout.in_shape) - 1
    codes = arrays["codes"]
    q = jnp.stack([codes >> 4, codes & 0xF], axis=lead + 1).reshape(n_in, n_out)  # [in, out]
    values = jnp.asarray(NF4)[q.astype(jnp.int32)]
    o = jax.lax.broadcasted_iota(jnp.int32, (1, n_out), 1) + layout.row_start
    if layout.aligned:
        nb = n_in // nf4.BLOCK
        ib = jax.lax.broadcasted_iota(jnp.int32, (nb, 1), 0)
        absf = _scales(arrays["absmax"].reshape(nb, n_out), o * nb + ib, arrays["scale"], arrays["offset"])
        per = jnp.broadcast_to(absf[:, None, :], (nb, nf4.BLOCK, n_out)).reshape(n_in, n_out)
    else:
        held = jax.lax.iota(jnp.int32, layout.blocks) + layout.block_start
        absf = _scales(arrays["absmax"], held, arrays["scale"], arrays["offset"])
        i = jax.lax.broadcasted_iota(jnp.int32, (n_in, 1), 0)
        per = absf[(o * n_in + i) // nf4.BLOCK - layout.block_start]
    return (values * per).astype(dtype).reshape(layout.shape)


def dequantize_int8(arrays: dict[str, jax.Array], layout: Layout, dtype: jnp.dtype) -> jax.Array:
    """ŵ `[*in, *out]` in `dtype`: `q · (a_o · (1/127))` in float32."""
    s = arrays["scale"] * jnp.float32(int8.INV_127)
    return (arrays["codes"].astype(jnp.float32) * s).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def dequantize(arrays: dict[str, jax.Array], layout: Layout, dtype: jnp.dtype) -> jax.Array:
    """ŵ `[*in, *out]` in `dtype` from one layer's stored arrays (jitted per layout: an eager
    caller compiles it once, a traced one inlines it)."""
    if layout.kind == "nf4":
        return dequantize_nf4(arrays, layout, dtype)
    return dequantize_int8(arrays, layout, dtype)
