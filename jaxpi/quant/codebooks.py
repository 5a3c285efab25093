"""The code tables of bitsandbytes' 4-bit NF4 and 8-bit dynamic quantization, built as it builds them.

    NF4        16 values: quantiles of N(0, 1) scaled to [-1, 1] (QLoRA, appendix E), 0 exact
    NF4_BOUNDS the 15 float32 midpoints between neighbours: x maps to the number of bounds < x
    DYNAMIC    256 values: sign, a decimal exponent 10^(-6..0), a linear fraction (`create_dynamic_map`)
    DYNAMIC_LUT  the 65,536-bin lookup table bitsandbytes' CPU kernel quantizes the 8-bit codes with

Every table is float32 and reproduced bit for bit (`tests/test_quant.py` compares each with the
installed bitsandbytes). The arithmetic follows bitsandbytes 0.50.2's: torch's `linspace` rounds
`start + step · i` once; the fraction means are scaled by the decimal factor rounded to float32.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    F32,
)
# (c[i] + c[i+1]) / 2 in float32: the thresholds of torch's bucketize in bitsandbytes' default
# (CPU) quantizer. They equal the literals of its CUDA decision tree (`dQuantizeNF4`), the exact
# midpoints rounded once, since halving a float32 sum is exact.
NF4_BOUNDS = ((NF4[:-1] + NF4[1:]) / F32(2)).astype(F32)
NF4_ZERO = 7  # the code of 0.0


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32: step = (end − start)/(steps − 1) in float32, each value
    start + step·i (or end − step·(steps−1−i) past halfway) rounded once."""
    s, e = F32(start), F32(end)
    step = np.float64(F32((e - s) / F32(steps - 1)))
    i = np.arange(steps, dtype=np.float64)
    lo = (np.float64(s) + step * i).astype(F32)
    hi = (np.float64(e) - step * (steps - 1 - i)).astype(F32)
    return np.where(i < steps // 2, lo, hi).astype(F32)


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`): for each decimal
    exponent 10^(i − 6), i = 0..6, the means of 2^i + 1 evenly spaced fractions in [0.1, 1], both
    signs; then 0 and 1; sorted. 256 distinct float32 values in [-0.99297, 1]."""
    data: list[float] = []
    non_sign = total_bits - 1
    for i in range(max_exponent_bits):
        bounds = _linspace(0.1, 1.0, 2 ** (i + non_sign - max_exponent_bits) + 1)
        means = ((bounds[:-1] + bounds[1:]) / F32(2)).astype(F32)
        scaled = (F32(10.0 ** (-(max_exponent_bits - 1) + i)) * means).astype(F32)
        data += scaled.tolist() + (-scaled).tolist()
    data += [0.0, 1.0]
    table = np.array(sorted(data), F32)
    if table.size != 2**total_bits:
        raise AssertionError(f"dynamic map has {table.size} values")
    return table


DYNAMIC = dynamic_map()

LUT_SIZE = 65536


def _dynamic_lut() -> np.ndarray:
    """The CPU kernel's table: bin i stands for v_i = −1 + 2i/65535 (float32) and holds the code
    whose interval contains it, counting a midpoint 0.5·(c_j + c_{j+1}) as below v only when it
    is strictly below (`build_quantize_lut` in csrc/cpu_ops.cpp)."""
    mids = (F32(0.5) * (DYNAMIC[:-1] + DYNAMIC[1:])).astype(F32)
    i = np.arange(LUT_SIZE).astype(F32)
    v = (F32(-1.0) + (F32(2.0) * i) / F32(LUT_SIZE - 1)).astype(F32)
    return np.searchsorted(mids, v, side="left").astype(np.uint8)


DYNAMIC_LUT = _dynamic_lut()
