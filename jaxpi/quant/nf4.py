"""NF4 with double-quantized block scales, as bitsandbytes stores a QLoRA base (`quant_type="nf4"`,
`blocksize=64`, `compress_statistics=True`), on the host and bit for bit.

A weight is read in torch's layout `[out, in]`, flattened row-major, and cut into blocks of 64:

    a_b      = max |w| over block b                                   float32, one per block
    q_i      = #{bounds < w_i · (1 / a_b)}                             4 bits: NF4 code of w_i
    packed   = q_{2k} << 4 | q_{2k+1}                                  one byte per pair
    offset   = mean_b a_b
    (c_b, s) = 8-bit blockwise(a_b − offset), blocks of 256            uint8 c_b, float32 s_j
    ŵ_i      = NF4[q_i] · (DYNAMIC[c_b] · s_{b // 256} + offset)       float32, then the compute dtype

That is 0.5 byte per weight for the codes, 1/64 for the 8-bit scales and 4/16384 for the second
level: 0.5157 byte per parameter, against 2 in bf16.

The rounding follows bitsandbytes 0.50.2 on the CPU, the backend this machine runs, step by
step: full blocks are scaled by the reciprocal of their absmax, a ragged last block divided by
it; a block of zeros gets code 7 (0.0) and absmax 0 (1e-38 when it is the ragged last one); a
value on a midpoint takes the lower code;
the 8-bit codes come from the CPU kernel's 65,536-bin table (`DYNAMIC_LUT`), not from a search.
Two steps are bitsandbytes' own choices that jaxpi does not copy:

- `offset` is the mean of the absmax values, which torch sums with vector lanes and threads, so
  its last bits depend on the machine and on `torch.get_num_threads()` for arrays over 32,768
  blocks (measured: docs/qlora.md). jaxpi sums in float64 and rounds once. Everything downstream
  of the offset is bit-identical given the same offset (`quantize(..., offset=)`).
- bitsandbytes' CUDA kernel finds the 8-bit code by binary search over the exact map, the CPU
  kernel through the 65,536-bin table: the two differ where a scale's normalised value lies
  within ~1.5e-5 of zero. jaxpi follows the CPU kernel, the one its tests can run.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxpi.quant.codebooks import DYNAMIC, DYNAMIC_LUT, F32, LUT_SIZE, NF4, NF4_BOUNDS, NF4_ZERO

BLOCK = 64  # weights per NF4 block (bitsandbytes' QLoRA default)
SCALE_BLOCK = 256  # 8-bit scales per second-level block (bitsandbytes' fixed nested blocksize)
# torch's `clamp(min=1e-38)` of a block's absmax before the reciprocal (a float32 subnormal)
TINY = F32(1e-38)


@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """One tensor quantized, in bitsandbytes' flat order (`QuantState` with `state2`).

    codes `[ceil(n/2)]` uint8 (element 2k in the high nibble; an odd tail padded with code 7),
    absmax `[nb]` uint8 (8-bit codes of a_b − offset), scale `[ceil(nb/256)]` float32 (the second
    level's absmax), offset float32, shape the weight's torch shape `[out, in]`.
    """

    codes: np.ndarray
    absmax: np.ndarray
    scale: np.ndarray
    offset: np.float32
    shape: tuple[int, ...]


def _nf4_codes(scaled: np.ndarray) -> np.ndarray:
    """#{bounds < x} per element: torch's bucketize(right=False), a value on a bound goes down
    (15 comparisons: four times faster than a search on this CPU)."""
    q = np.zeros(scaled.shape, np.uint8)
    for bound in NF4_BOUNDS:
        q += scaled > bound
    return q


def block_codes(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """NF4 codes `[n]` (uint8 0..15, unpacked) and block absmax `[ceil(n/block)]` (float32) of the
    flat float32 array x: bitsandbytes' `quantize_4bit` of the default (CPU) backend. Full blocks
    run in row chunks on a thread pool (numpy releases the GIL)."""
    x = np.ascontiguousarray(x, F32).reshape(-1)
    n = x.size
    full = n - n % block
    head = x[:full].reshape(-1, block)
    codes = np.empty(n, np.uint8)
    amax = np.empty(-(-n // block), F32)

    def rows(lo: int, hi: int) -> None:
        h = head[lo:hi]
        a = np.abs(h).max(axis=1)
        # reciprocal then product, as torch's `A * (1.0 / absmax.clamp(min=1e-38))`: not a division
        inv = (F32(1.0) / np.maximum(a, TINY)).astype(F32)
        codes[lo * block : hi * block] = _nf4_codes(np.clip(h * inv[:, None], F32(-1), F32(1))).reshape(-1)
        amax[lo:hi] = a

    step = 1 << 16  # blocks per task (4M weights)
    spans = [(lo, min(lo + step, head.shape[0])) for lo in range(0, head.shape[0], step)]
    if len(spans) > 1:
        with ThreadPoolExecutor(min(len(spans), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda s: rows(*s), spans))
    elif spans:
        rows(*spans[0])
    if full < n:
        # the ragged last block, the same code's other branch: divided, not multiplied, and its
        # absmax stored after the clamp (a zero tail keeps 1e-38, a zero full block 0)
        tail = x[full:]
        tmax = np.maximum(np.abs(tail).max(), TINY)
        codes[full:] = _nf4_codes(np.clip(tail / tmax, F32(-1), F32(1)))
        amax[-1] = tmax
    return codes, amax


def pack(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte, the first in the high nibble; an odd count padded with code 7 (0.0)."""
    if codes.size % 2:
        codes = np.concatenate([codes, np.array([NF4_ZERO], np.uint8)])
    return ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)


def unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """The first n codes of `pack`'s bytes."""
    out = np.empty(packed.size * 2, np.uint8)
    out[0::2], out[1::2] = packed >> 4, packed & 0xF
    return out[:n]


def blockwise_8bit(x: np.ndarray, block: int = SCALE_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """8-bit codes of the dynamic map `[n]` and block absmax (float32) of x: bitsandbytes' CPU
    `quantize_blockwise` (`quantize_cpu_impl`).

        a = max |x| over the block (0 → every code 0)
        v = clamp(x · (1/a), −1, 1)
        code = LUT[uint16((v + 1) · 0.5 · 65535 + 0.5)]     float32 steps, truncated
    """
    x = np.ascontiguousarray(x, F32).reshape(-1)
    n = x.size
    nb = -(-n // block)
    pad = np.zeros(nb * block, F32)
    pad[:n] = x
    blocks = pad.reshape(nb, block)
    amax = np.abs(blocks).max(axis=1).astype(F32)  # zero padding never raises a block's max
    zero = amax == 0
    inv = (F32(1.0) / np.where(zero, F32(1), amax)).astype(F32)
    v = np.clip(blocks * inv[:, None], F32(-1), F32(1)).astype(F32)
    t = ((v + F32(1)) * F32(0.5)).astype(F32)
    t = (t * F32(LUT_SIZE - 1)).astype(F32)
    t = (t + F32(0.5)).astype(F32)
    codes = DYNAMIC_LUT[t.astype(np.uint16)]
    codes[zero] = 0
    return codes.reshape(-1)[:n], amax


def mean_offset(absmax: np.ndarray) -> np.float32:
    """The offset jaxpi subtracts: the mean of the block absmax, summed in float64, rounded once
    (bitsandbytes takes torch's float32 mean; see the module docstring)."""
    return F32(np.mean(absmax, dtype=np.float64))


def quantize(w: np.ndarray, *, offset: float | None = None) -> NF4Tensor:
    """Quantize a float weight (torch layout `[out, in]`, any shape) as bitsandbytes' QLoRA does.
    `offset` replaces jaxpi's mean (to reproduce a bitsandbytes state whose offset is known)."""
    w = np.asarray(w)
    if not np.all(np.isfinite(w)):
        raise ValueError("nf4: the weight holds NaN or Inf values, which have no NF4 code")
    codes, amax = block_codes(w.astype(F32))
    off = mean_offset(amax) if offset is None else F32(offset)
    c8, scale = blockwise_8bit((amax - off).astype(F32))
    return NF4Tensor(pack(codes), c8, scale, off, tuple(int(s) for s in w.shape))


def block_scales(t: NF4Tensor) -> np.ndarray:
    """The float32 absmax of every block, as bitsandbytes dequantizes them: `DYNAMIC[c]·s` rounded,
    then `+ offset` rounded (two roundings; an FMA would give other last bits)."""
    idx = np.arange(t.absmax.size) // SCALE_BLOCK
    prod = (DYNAMIC[t.absmax] * t.scale[idx]).astype(F32)
    return (prod + t.offset).astype(F32)


def dequantize(t: NF4Tensor) -> np.ndarray:
    """ŵ in float32 with `t.shape`: `NF4[q] · absmax_b`, bitsandbytes' arithmetic."""
    n = int(np.prod(t.shape))
    q = unpack(t.codes, n)
    a = block_scales(t)
    return (NF4[q] * a[np.arange(n) // BLOCK]).astype(F32).reshape(t.shape)
