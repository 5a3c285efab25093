"""`jaxpi.kernels.dense` (inference projections) and the embedding gather of inference: the same
values as the training path's einsum / take, and on XLA:CPU no float32 copy of a bf16 weight."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpi.kernels.dense import dense
from jaxpi.models.qwen3_5 import embed_rows

EQS = {1: ("btd,dhk->bthk", (2, 3)), 2: ("bthk,hkd->btd", (5,))}


def _operands(rng, b, t, n_in, dtype):
    eq, out = EQS[n_in]
    x_in = (6,) if n_in == 1 else (2, 3)
    w_shape = (*x_in, *out)
    x = rng.standard_normal((b, t, *x_in)).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    return eq, jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), t=st.integers(1, 3), n_in=st.sampled_from([1, 2]))
def test_dense_is_the_einsum_accumulated_in_float32(b, t, n_in):
    rng = np.random.default_rng(b * 10 + t + n_in)
    eq, x, w = _operands(rng, b, t, n_in, jnp.bfloat16)
    got = jax.jit(lambda x, w: dense(eq, x, w, n_in=n_in))(x, w)
    want = jnp.einsum(eq, x.astype(jnp.float32), w.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    # one rounding of the float32 sum to bf16: within half a bf16 ulp (2^-9 relative) of it, plus
    # the float32 sum's own order
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-6)
    # float32 weights: XLA's own product, bit for bit
    eq, x32, w32 = _operands(rng, b, t, n_in, jnp.float32)
    f = jax.jit(lambda x, w: dense(eq, x, w, n_in=n_in))
    np.testing.assert_array_equal(f(x32, w32), jax.jit(lambda x, w: jnp.einsum(eq, x, w))(x32, w32))


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_no_float32_copy_of_a_bf16_weight_on_the_cpu(rows, monkeypatch):
    """XLA:CPU's bf16 kernel reads the weight as stored; a single row is padded to two, since XLA
    turns a one-row product into a float32 matrix-vector product on a float32 copy. (XLA's path,
    where the native kernel for few rows does not run: it is switched off here.)"""
    monkeypatch.setattr("jaxpi.kernels.cpu.rows.available", lambda: False)
    w = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((rows, 1, 256), jnp.bfloat16)
    hlo = jax.jit(lambda x, w: dense("btd,df->btf", x, w)).lower(x, w).compile().as_text()
    assert not re.search(r"f32\[(256,384|384,256)\]", hlo), "a float32 copy of the weight"
    plain = jax.jit(lambda x, w: jnp.einsum("btd,df->btf", x, w)).lower(x, w).compile().as_text()
    assert re.search(r"f32\[(256,384|384,256)\]", plain), (
        "the plain einsum no longer copies: drop the padding?"
    )


def test_inference_gathers_16_bit_rows_as_bits():
    table = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)), jnp.bfloat16)
    ids = jnp.asarray([[3, 0, 63], [5, 5, 1]])
    np.testing.assert_array_equal(embed_rows(table, ids, inference=True), jnp.take(table, ids, axis=0))
    hlo = jax.jit(lambda t, i: embed_rows(t, i, inference=True)).lower(table, ids).compile().as_text()
    assert "f32[64,8]" not in hlo
    # what the bits avoid: XLA:CPU gathers bf16 rows from a float32 copy of the whole table
    assert "f32[64,8]" in jax.jit(lambda t, i: jnp.take(t, i, axis=0)).lower(table, ids).compile().as_text()
