"""Row-wise absmax int8, as bitsandbytes stores an LLM.int8 base (`Int8Params`), on the host and bit
for bit.

    w16     = w cast to float16                       (bitsandbytes quantizes the fp16 copy)
    a_o     = max_i |w16[o, i]|                        float32, one per output row
    q[o, i] = round_half_even(w16[o, i] · ((1 / a_o) · 127)) int8, each step rounded to float32
    ŵ[o, i] = q[o, i] · (a_o · (1/127))                float32: two roundings, then the compute dtype

1 byte per weight plus 4 per row. The dequantized matmul is what bitsandbytes runs on the CPU in
training (`MatMul8bitFp`); its GPU kernels quantize the activations too (LLM.int8's outlier
split at `llm_int8_threshold`), which jaxpi does not: jaxpi's int8 base is this weight format
with dequantize-on-the-fly matmuls.
"""

from __future__ import annotations

import dataclasses

import numpy as np

F32 = np.float32
INV_127 = F32(1.0 / 127.0)  # torch's `SCB.mul(1.0 / 127.0)` rounds the scalar to float32


@dataclasses.dataclass(frozen=True)
class Int8Tensor:
    """codes `[out, in]` int8 and the rows' absmax `[out]` float32 (bitsandbytes' CB and SCB)."""

    codes: np.ndarray
    scale: np.ndarray


def quantize(w: np.ndarray) -> Int8Tensor:
    """bitsandbytes' `int8_vectorwise_quant(w.to(float16))` of a 2-D weight `[out, in]`."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"int8: expected a 2-D weight [out, in], got shape {w.shape}")
    w16 = w.astype(np.float16).astype(F32)
    if not np.all(np.isfinite(w16)):
        raise ValueError("int8: the weight holds values that are not finite in float16")
    amax = np.abs(w16).max(axis=1).astype(F32)
    # torch evaluates `127.0 / a` as reciprocal(a) · 127 (two roundings, not one division); a
    # zero row (a_o = 0) gets codes 0 (its scale is 0, so it dequantizes to 0 whatever the codes:
    # bitsandbytes' cast of NaN is undefined there)
    recip = (F32(1.0) / np.where(amax == 0, F32(1), amax)).astype(F32)
    mult = (recip * F32(127.0)).astype(F32)
    q = np.rint(w16 * mult[:, None]).astype(np.int8)
    q[amax == 0] = 0
    return Int8Tensor(q, amax)


def dequantize(t: Int8Tensor) -> np.ndarray:
    """ŵ in float32: `q · (a_o · (1/127))`, the two roundings of bitsandbytes' CPU training path."""
    s = (t.scale * INV_127).astype(F32)
    return (t.codes.astype(F32) * s[:, None]).astype(F32)
