"""jaxpi's NF4 and int8 quantizers against bitsandbytes 0.50.2 (CPU), bit for bit, and the JAX
dequantization against the host reference.

What "bit-identical" covers (docs/qlora.md): every 4-bit code, every block absmax before double
quantization, every 8-bit scale code and every second-level scale given the same offset, the
int8 codes and row scales, and the dequantized float32 weights. The offset (the mean of the
block absmax) is jaxpi's float64 mean, within an ulp or two of torch's float32 one, whose last
bits depend on the CPU's vector width and thread count.
"""

from __future__ import annotations

import bitsandbytes.functional as F
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpi.quant import int8, nf4
from jaxpi.quant.codebooks import DYNAMIC, NF4, NF4_BOUNDS
from jaxpi.quant.stored import dequantize, int8_part, layout_for, nf4_part

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# The 15 thresholds of bitsandbytes' CUDA decision tree (`dQuantizeNF4` in csrc/kernels.cu).
CUDA_NF4_THRESHOLDS = [
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
]  # fmt: skip


def test_tables_are_bitsandbytes():
    assert np.array_equal(NF4, F.get_4bit_type("nf4", device="cpu").numpy())
    assert np.array_equal(DYNAMIC, F.create_dynamic_map().numpy())
    # the float32 midpoints are the CUDA kernel's literals too: both quantizers cut at the same places
    assert np.array_equal(NF4_BOUNDS, np.array(CUDA_NF4_THRESHOLDS, np.float32))


@st.composite
def weights(draw, max_size: int = 2500) -> tuple[np.ndarray, str]:
    """A flat weight in a storage dtype: Gaussian at a drawn magnitude, some blocks zero, a few
    outliers, values exactly on NF4 midpoints (ties), any length (ragged last blocks)."""
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    n = draw(st.integers(1, max_size))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    # tiny, ordinary and huge magnitudes (float16 holds only the ordinary ones)
    lo, hi = (
        (-4.0, 3.0)
        if dtype == "float16"
        else draw(st.sampled_from([(-30.0, -8.0), (-6.0, 2.0), (8.0, 30.0)]))
    )
    scale = 10.0 ** draw(st.floats(lo, hi))
    x = rng.standard_normal(n) * scale
    if draw(st.booleans()):  # zero blocks and a zero tail
        x[rng.integers(0, n, max(1, n // 50)) // 64 * 64] = 0.0
        x[: min(n, 64 * draw(st.integers(0, 3)))] = 0.0
    if draw(st.booleans()):  # ties: a block whose absmax is 1 and whose other values are midpoints
        k = min(n, 64)
        x[:k] = np.resize(np.concatenate([[1.0], NF4_BOUNDS, -NF4_BOUNDS]), k) * scale
    if draw(st.booleans()):
        x[rng.integers(0, n)] *= 1e3 if dtype != "float16" else 10.0
    return x.astype(NUMPY[dtype]), dtype


def _bnb(x: np.ndarray, dtype: str):
    t = torch.from_numpy(x.astype(np.float32)).to(TORCH[dtype])
    return F.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=True)


@settings(max_examples=50, **SETTINGS)
@given(weights())
def test_nf4_codes_and_scales_are_bitsandbytes(drawn):
    x, dtype = drawn
    packed, state = _bnb(x, dtype)
    codes, amax = nf4.block_codes(x.astype(np.float32))
    assert np.array_equal(nf4.pack(codes), packed.numpy().reshape(-1))
    # given bitsandbytes' offset, every scale code and second-level scale is bitsandbytes'
    ours = nf4.quantize(x.astype(np.float32), offset=state.offset.item())
    assert np.array_equal(ours.codes, packed.numpy().reshape(-1))
    assert np.array_equal(ours.absmax, state.absmax.numpy())
    assert np.array_equal(ours.scale, state.state2.absmax.numpy())
    assert ours.offset == np.float32(state.offset.item())
    # jaxpi's own offset: the float64 mean, a couple of ulps from torch's float32 one at most
    ulps = np.float32(nf4.mean_offset(amax)).view(np.int32) - np.float32(state.offset.item()).view(np.int32)
    assert abs(int(ulps)) <= 2
    # the dequantized weights: bitsandbytes' float32 arithmetic (a 1-D state is one row, which
    # every bitsandbytes CPU kernel indexes correctly; see test_bitsandbytes_cpu_rows)
    deq = F.dequantize_4bit(packed, state).float().numpy().reshape(-1)  # (a [1, n] state comes back [n, 1])
    assert np.array_equal(nf4.dequantize(ours).astype(NUMPY[dtype]).astype(np.float32), deq)


@settings(max_examples=40, **SETTINGS)
@given(st.integers(1, 1200), st.integers(0, 2**31), st.floats(-8.0, 8.0))
def test_8bit_scales_are_bitsandbytes(n, seed, mag):
    """The double quantization's 8-bit step alone: values near zero (below the 65,536-bin table's
    resolution), zero blocks, ragged blocks."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0**mag).astype(np.float32)
    x[rng.integers(0, n, max(1, n // 8))] *= 1e-6
    if n > 300:
        x[256:512] = 0.0
    codes, amax = nf4.blockwise_8bit(x)
    ref_codes, ref_state = F.quantize_blockwise(torch.from_numpy(x), blocksize=256)
    assert np.array_equal(codes, ref_codes.numpy())
    assert np.array_equal(amax, ref_state.absmax.numpy())


def test_ties_take_the_lower_code():
    """A value exactly on a midpoint goes to the lower code, as bitsandbytes' bucketize (and its CUDA
    tree's `x > t`) put it; the upper choice fails here."""
    x = np.concatenate([[1.0], NF4_BOUNDS]).astype(np.float32)
    codes, _ = nf4.block_codes(x)
    assert codes[1:].tolist() == list(range(15))
    packed, _ = _bnb(x, "float32")
    assert np.array_equal(nf4.pack(codes), packed.numpy().reshape(-1))


def test_full_blocks_multiply_the_ragged_tail_divides():
    """x = 0.15324634 in a block whose absmax is a = 0.52479148: x / a is exactly the bound between
    codes 10 and 11 (→ 10), x · (1/a) one ulp above it (→ 11). bitsandbytes multiplies in full
    blocks and divides in the ragged last one; so does jaxpi (either way round fails here)."""
    a, x = np.float32(0.5247914791107178), np.float32(0.15324634313583374)
    full = np.zeros(64, np.float32)
    full[:2] = [a, x]
    tail = np.concatenate([full, [a, x]]).astype(np.float32)
    for values, where, code in ((full, 1, 11), (tail, -1, 10)):
        codes, _ = nf4.block_codes(values)
        assert codes[where] == code
        packed, _ = _bnb(values, "float32")
        assert np.array_equal(nf4.pack(codes), packed.numpy().reshape(-1))


@settings(max_examples=30, **SETTINGS)
@given(st.integers(1, 40), st.integers(1, 70), st.integers(0, 2**31), st.floats(-4.0, 3.0))
def test_int8_is_bitsandbytes(rows, cols, seed, mag):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 10.0**mag).astype(np.float32)
    w[rng.integers(0, rows)] = 0.0  # a zero row
    if cols > 1:  # a tie: absmax 127 scales by exactly 1, and 62.5 rounds half to even (62)
        w[0] = 0.0
        w[0, :2] = [127.0, 62.5]
    t = int8.quantize(w)
    cb, scb, _ = F.int8_vectorwise_quant(torch.from_numpy(w).to(torch.float16))
    assert np.array_equal(t.codes, cb.numpy())
    assert np.array_equal(t.scale, scb.numpy())
    # bitsandbytes' CPU training matmul dequantizes as CB · (SCB · (1/127)) (`MatMul8bitFp`)
    ref = cb.to(torch.float32).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
    assert np.array_equal(int8.dequantize(t), ref.numpy())


def test_round_trip():
    """ŵ is NF4 code × block scale: re-quantizing ŵ gives the same codes; zeros stay exactly zero;
    the error is that of a 4-bit grid (NF4 on Gaussian weights: ~9% relative in L2)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 256)) * 0.02).astype(np.float32)
    w[3, :64] = 0.0
    t = nf4.quantize(w)
    hat = nf4.dequantize(t)
    assert np.array_equal(nf4.quantize(hat).codes, t.codes)
    assert np.all(hat[3, :64] == 0.0)
    rel = np.linalg.norm(hat - w) / np.linalg.norm(w)
    assert 0.05 < rel < 0.12, rel
    q8 = int8.quantize(w)
    err = np.abs(int8.dequantize(q8) - w.astype(np.float16).astype(np.float32))
    assert np.all(err <= q8.scale[:, None] / 254 * 1.0001)


@pytest.mark.parametrize(
    ("rows", "n_in", "parts", "in_shape"),
    [
        (96, 128, [(0, 32), (32, 64), (64, 96)], (128,)),  # a fused tensor split in three (in_proj_qkv)
        (64, 192, [(0, 64)], (6, 32)),  # an output projection [heads, dim, out] (out_proj)
        (64, 96, [(0, 64)], (6, 16)),  # input not a multiple of 64: flat scales (toy configs only)
        (48, 96, [(0, 16), (16, 48)], (96,)),  # the same, split
    ],
)
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_jax_dequantize_is_the_reference(rows, n_in, parts, in_shape, kind):
    """Each stored part dequantized in JAX (float32 and bf16) equals its rows of the host reference,
    bit for bit."""
    rng = np.random.default_rng(rows + n_in)
    w = (rng.standard_normal((rows, n_in)) * 0.03).astype(np.float32)
    t = nf4.quantize(w) if kind == "nf4" else int8.quantize(w)
    ref = nf4.dequantize(t) if kind == "nf4" else int8.dequantize(t)
    for r0, r1 in parts:
        out_shape = (r1 - r0,) if len(in_shape) > 1 else (2, (r1 - r0) // 2)
        layout = layout_for(kind, in_shape, out_shape, rows=(r0, r1), total_rows=rows)
        arrays = nf4_part(t, layout) if kind == "nf4" else int8_part(t, layout)
        want = ref[r0:r1].T.reshape(layout.shape)  # torch [out, in] rows → jaxpi [*in, *out]
        for dtype in (jnp.float32, jnp.bfloat16):
            got = np.asarray(dequantize({k: jnp.asarray(v) for k, v in arrays.items()}, layout, dtype))
            assert np.array_equal(got, want.astype(dtype)), (kind, dtype, (r0, r1))


FMA_CHECK = """
import numpy as np, jax.numpy as jnp
from jaxpi.quant import nf4
from jaxpi.quant.stored import dequantize, layout_for, nf4_part
w = (np.random.default_rng(0).standard_normal((256, 512)) * 0.03).astype(np.float32)
t = nf4.quantize(w)
layout = layout_for("nf4", (512,), (256,), rows=(0, 256), total_rows=256)
got = dequantize({k: jnp.asarray(v) for k, v in nf4_part(t, layout).items()}, layout, jnp.float32)
print(int((np.asarray(got) != nf4.dequantize(t).T).sum()))
"""


def test_dequantize_is_exact_under_xla_default_optimisation():
    """At XLA's default optimisation LLVM contracts `DYNAMIC[c]·s + offset` into an FMA (9,539 of
    131,072 weights changed here without the guard in `_scales`); the suite's level 0 does not,
    so this check runs in a child process at the default level."""
    import subprocess
    import sys

    from jaxpi.testing.xla import child_env

    env = child_env(fast_compile=False)
    proc = subprocess.run(
        [sys.executable, "-c", FMA_CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "0", proc.stdout


def test_layout_refusals():
    with pytest.raises(ValueError, match="must be even"):
        layout_for("nf4", (7,), (4,), rows=(0, 4), total_rows=4)
    with pytest.raises(ValueError, match="base_quant must be one of none, nf4, int8, got 'fp4'"):
        layout_for("fp4", (64,), (4,), rows=(0, 4), total_rows=4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        nf4.quantize(np.array([1.0, np.nan], np.float32))
