"""The native CPU kernels (`jaxpi.kernels.cpu.rows`: products of rows with a bf16 weight,
`rows_bf16` for a few rows and `packed_bf16` on AVX-512 BF16 over a packed weight for more;
`delta_step`, one decode token of the gated delta rule) against float64, their use by `dense`
and `gated_delta_step`, the build that serves any x86-64 host, and the switch that turns them
off."""

import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpi.kernels.cpu import rows
from jaxpi.kernels.dense import NATIVE_ROWS, PACKED_ROWS, dense, packing

CPUINFO = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
AVX512 = "avx512bw" in CPUINFO
AVX512_BF16 = AVX512 and "avx512_bf16" in CPUINFO
pytestmark = pytest.mark.skipif(not AVX512, reason="the kernel needs AVX-512 (F, BW)")
needs_bf16 = pytest.mark.skipif(not AVX512_BF16, reason="packed_bf16 needs AVX-512 BF16")


def test_the_kernel_builds_and_registers():
    assert rows.available(), "no native kernel on an AVX-512 CPU: see the warning for the build error"
    assert any(p.name.startswith("rows_bf16-") for p in rows.cache_dir().iterdir())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(m=st.integers(1, 8), k=st.integers(1, 600), n=st.integers(1, 70), seed=st.integers(0, 3))
def test_rows_times_weight_against_float64(m, k, n, seed):
    """Every shape the blocking can meet: K across 256-row blocks and with 1-3 rows over a multiple
    of 4, N with a partial last vector of 16."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    got = np.asarray(jax.jit(rows.rows_bf16)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 sums of k exact products: error within k·2^-24 of the sum of magnitudes
    bound = k * 2.0**-24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))) + 1e-30
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert np.all(np.abs(got - want) <= bound)
    # the same bits on every call, whichever thread ran which block of rows
    np.testing.assert_array_equal(np.asarray(jax.jit(rows.rows_bf16)(x, w)), got)


@needs_bf16
@settings(max_examples=25, deadline=None, derandomize=True)
@given(k=st.integers(1, 70), n=st.integers(1, 1100), seed=st.integers(0, 3))
def test_pack_lays_out_pairs_of_rows_per_strip_of_32_columns(k, n, seed):
    """Across the kernel's tiles (16 row pairs by 32 strips) and their partial edges."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    got = np.asarray(jax.jit(rows.pack)(jnp.asarray(w, jnp.bfloat16)), np.float32)
    assert got.shape == (-(-n // 32), -(-k // 2), 64)
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    s_, p, c, j = np.meshgrid(*map(np.arange, (got.shape[0], got.shape[1], 32, 2)), indexing="ij")
    row, col = 2 * p + j, 32 * s_ + c
    want = np.where((row < k) & (col < n), wb[np.minimum(row, k - 1), np.minimum(col, n - 1)], 0.0)
    np.testing.assert_array_equal(got, want.reshape(got.shape))


@needs_bf16
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    m=st.integers(1, rows.MAX_PACKED_ROWS),
    k=st.integers(1, 600),
    n=st.integers(1, 100),
    scale=st.tuples(st.integers(-40, 40), st.integers(-40, 40)),
    seed=st.integers(0, 3),
)
def test_packed_against_float64(m, k, n, scale, seed):
    """Every shape the kernel meets: rows in passes of 8 with a partial last pass, K odd (the last
    row's partner is the packing's zero and x has no value past K), N with a partial last strip;
    magnitudes from 2^-40 to 2^40 (products stay above float32's normal range, where vdpbf16ps
    flushes)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 2.0 ** scale[0], jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 2.0 ** scale[1], jnp.bfloat16)
    f = jax.jit(lambda x, w: rows.packed_bf16(x, rows.pack(w), n))
    got = np.asarray(f(x, w))
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = k * 2.0**-24 * (np.abs(xd) @ np.abs(wd))
    assert got.dtype == np.float32 and got.shape == (m, n)
    bad = np.argwhere(np.abs(got - xd @ wd) > bound)
    assert bad.size == 0, f"m={m} k={k} n={n}: first bad element {bad[0].tolist()}"
    np.testing.assert_array_equal(np.asarray(f(x, w)), got)  # one order per element, any thread


@needs_bf16
@settings(max_examples=8, deadline=None, derandomize=True)
@given(m=st.integers(1, 4), k=st.integers(1, 300), n=st.integers(65, 3000), seed=st.integers(0, 3))
def test_few_rows_read_strips_side_by_side_with_the_bits_of_one_at_a_time(m, k, n, seed):
    """Up to 4 rows the kernel reads two strips at once (runs of strips claimed per thread); the
    rows of an 8-row product (one strip at a time) are the same bits, and both are near float64."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    packed = rows.pack(w)
    few = np.asarray(rows.packed_bf16(x[:m], packed, n))
    np.testing.assert_array_equal(
        few, np.asarray(rows.packed_bf16(x, packed, n))[:m], err_msg=f"m={m} k={k} n={n}"
    )
    xd, wd = np.asarray(x[:m], np.float64), np.asarray(w, np.float64)
    assert np.all(np.abs(few - xd @ wd) <= k * 2.0**-24 * (np.abs(xd) @ np.abs(wd)))


@needs_bf16
def test_packed_flushes_below_the_normal_range_and_checks_its_operands():
    """vdpbf16ps treats inputs below 2^-126 as zero: the documented difference from XLA's product."""
    one = rows.pack(jnp.ones((4, 3), jnp.bfloat16))
    assert np.all(np.asarray(rows.packed_bf16(jnp.full((2, 4), 2.0**-130, jnp.bfloat16), one, 3)) == 0)
    got = np.asarray(rows.packed_bf16(jnp.full((2, 4), 2.0**-120, jnp.bfloat16), one, 3))
    assert np.all(got == 4 * 2.0**-120)
    with pytest.raises(ValueError, match="not a \\[5, 3\\] weight"):
        rows.packed_bf16(jnp.ones((2, 5), jnp.bfloat16), one, 3)
    with pytest.raises(ValueError, match="M <= 256"):
        rows.packed_bf16(jnp.ones((257, 4), jnp.bfloat16), one, 3)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the library")
def test_only_the_kernel_uses_avx512_so_any_x86_64_may_load_the_library():
    """One build serves hosts with and without AVX-512 (a cache shared over NFS): loading the
    library, asking it whether the CPU runs the kernel, and the handler's own set-up use no
    AVX-512 register; only the functions compiled for AVX-512 (namespace `avx512`) do."""
    assert rows.available()
    out = subprocess.run(
        ["objdump", "-d", "-C", str(rows.build())], capture_output=True, text=True, check=True
    )
    users, name = set(), None
    for line in out.stdout.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1][:-2]
        elif "zmm" in line and name is not None:
            users.add(name)
    assert users and all("::avx512::" in u for u in users), sorted(users)


def test_dense_sends_few_rows_to_the_kernel():
    w = jax.ShapeDtypeStruct((64, 4, 8), jnp.bfloat16)

    def hlo(rows_, dtype=jnp.bfloat16):
        x = jax.ShapeDtypeStruct((rows_, 1, 64), dtype)
        return jax.jit(lambda x, w: dense("btd,dhk->bthk", x, w)).lower(x, w).as_text()

    assert rows.TARGET in hlo(1) and rows.TARGET in hlo(NATIVE_ROWS)
    assert rows.TARGET not in hlo(NATIVE_ROWS + 1)
    # more rows: the packed kernel only inside `packing()` (the engine's decode loop), up to
    # PACKED_ROWS; then XLA's own product
    assert rows.PACKED_TARGET not in hlo(NATIVE_ROWS + 1)
    if AVX512_BF16:
        with packing():
            assert rows.PACKED_TARGET in hlo(NATIVE_ROWS + 1) and rows.PACKED_TARGET in hlo(PACKED_ROWS)
            assert rows.PACKED_TARGET not in hlo(NATIVE_ROWS) and rows.PACKED_TARGET not in hlo(
                PACKED_ROWS + 1
            )
            assert rows.PACK_TARGET in hlo(PACKED_ROWS)
    # a product with an axis in both operands (h) is not rows times the weight as stored
    x1 = jax.ShapeDtypeStruct((1, 4, 64), jnp.bfloat16)
    shared = jax.jit(lambda x, w: dense("bhd,dhk->bhk", x, w)).lower(x1, w).as_text()
    assert rows.TARGET not in shared
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 2, 3)), jnp.bfloat16)
    wo = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 5)), jnp.bfloat16)
    got = dense("bthk,hkd->btd", x, wo, n_in=2)
    want = jnp.einsum("bthk,hkd->btd", x.astype(jnp.float32), wo.astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7)
    with pytest.raises(ValueError, match="rows_bf16 takes"):
        rows.rows_bf16(jnp.zeros((9, 4), jnp.bfloat16), jnp.zeros((4, 2), jnp.bfloat16))


def test_the_switch_turns_the_kernel_off():
    code = "from jaxpi.kernels.cpu import rows; print(rows.available() or rows.packed_available())"
    env = {"JAXPI_CPU_KERNELS": "off", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 5),
    kd=st.integers(1, 40),
    vd=st.integers(1, 40),
    g_scale=st.floats(0.0, 8.0),
    seed=st.integers(0, 3),
)
def test_delta_step_against_float64(b, h, kd, vd, g_scale, seed):
    """One decode token of the gated delta rule (`rows.delta_step`) against the equations in
    float64, for any head sizes (V not a multiple of 16: masked columns), decays from 1 to e^-8
    and learning rates in (0, 1); each element within a float32 rounding of its terms' size."""
    rng = np.random.default_rng(seed)
    state, q, k, v = (rng.standard_normal(s) for s in ((b, h, kd, vd), (b, h, kd), (b, h, kd), (b, h, vd)))
    g, beta = -g_scale * rng.random((b, h)), rng.random((b, h))
    f32 = [jnp.asarray(x, jnp.float32) for x in (state, q, k, v, g, beta)]
    state, q, k, v, g, beta = (np.asarray(x, np.float64) for x in f32)
    out, new = (np.asarray(x, np.float64) for x in jax.jit(rows.delta_step)(*f32))
    d = np.exp(g)[..., None]
    u = beta[..., None] * (v - d * np.einsum("bhkv,bhk->bhv", state, k))
    want_state = d[..., None] * state + k[..., :, None] * u[..., None, :]
    want_out = np.einsum("bhkv,bhk->bhv", want_state, q)
    # sizes of the terms each element sums, for the rounding bound
    mag_u = beta[..., None] * (np.abs(v) + d * np.einsum("bhkv,bhk->bhv", np.abs(state), np.abs(k)))
    mag_state = d[..., None] * np.abs(state) + np.abs(k)[..., :, None] * mag_u[..., None, :]
    mag_out = np.einsum("bhkv,bhk->bhv", mag_state, np.abs(q))
    eps = 4 * (kd + 4) * 2.0**-24
    assert np.all(np.abs(new - want_state) <= eps * mag_state + 1e-30), f"b={b} h={h} kd={kd} vd={vd}"
    assert np.all(np.abs(out - want_out) <= eps * mag_out + 1e-30), f"b={b} h={h} kd={kd} vd={vd}"


def test_the_decode_step_of_the_gated_delta_rule_runs_natively_in_float32_only():
    """`gated_delta_step` makes one native call on float32 (the engine's state) and keeps XLA's
    equations on float64; both give the float64 equations' output."""
    from jaxpi.kernels.gated_delta import gated_delta_step

    rng = np.random.default_rng(0)
    shapes = ((2, 2, 8), (2, 2, 8), (2, 4, 12), (2, 4), (2, 4), (2, 4, 8, 12))  # q, k, v, g, beta, state
    args = [rng.standard_normal(s) for s in shapes]
    args[3] = -np.abs(args[3])
    hlo32 = jax.jit(gated_delta_step).lower(*(jnp.asarray(a, jnp.float32) for a in args)).as_text()
    assert rows.DELTA_TARGET in hlo32
    with jax.enable_x64(True):
        a64 = [jnp.asarray(a, jnp.float64) for a in args]
        assert rows.DELTA_TARGET not in jax.jit(gated_delta_step).lower(*a64).as_text()
        want = [np.asarray(x) for x in gated_delta_step(*a64)]
    got = gated_delta_step(*(jnp.asarray(a, jnp.float32) for a in args))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=1e-4, atol=1e-5)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    v=st.integers(1, 300),
    d=st.integers(1, 70),
    n=st.integers(0, 40),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    kind=st.sampled_from(["int32", "uint32", "int64"]),
    seed=st.integers(0, 3),
)
def test_take_rows16_gives_the_bits_of_jnp_take(v, d, n, dtype, kind, seed):
    """The embedding lookup (`rows.take_rows16`) against `jnp.take` of the table's bits, for any
    table and ids in and far out of range: from the end for [-V, 0), a row of 0xFFFF past it."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, (v, d), dtype=np.uint16)
    lo = 0 if kind == "uint32" else -3 * v
    ids = rng.integers(lo, 3 * v + 1, (2, n)).astype(kind)
    if kind != "int32":
        ids[0, :1] = np.iinfo(kind).max  # as far out as the dtype goes
    with jax.enable_x64(kind == "int64"):
        table = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.dtype(dtype))
        got = jax.jit(rows.take_rows16)(table, jnp.asarray(ids))
        want = jnp.take(jnp.asarray(bits), jnp.asarray(ids), axis=0)
        assert got.dtype == table.dtype and got.shape == (2, n, d)
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16)), np.asarray(want), err_msg=f"ids {ids}"
        )
