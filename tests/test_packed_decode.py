"""Packed sequences and the decode cache, on the whole model (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpi import TINY, load_hf
from jaxpi.config import FULL, LINEAR
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.models.layers import RECURRENT_PREFILL_MAX
from jaxpi.models.qwen3_5 import concat_cache_rows, layer_plan, segment_positions

FWD = jax.jit(lambda m, x: m(x))
STEP = jax.jit(lambda m, x, c: m(x, cache=c))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Two stacked groups of (DeltaNet, attention) and an unrolled DeltaNet tail: every code path of
    # the layers in 5 layers, about half the compile time of the default pattern's 9 (3 DeltaNet +
    # 1 attention per group, decoded in test_jax_engine.py and, looped, in test_scan_loop.py).
    cfg = TINY.replace(num_hidden_layers=5, layer_types=(LINEAR, FULL) * 2 + (LINEAR,))
    assert layer_plan(cfg) == (2, 2)
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=11)
    return load_hf(ckpt)[1]


@pytest.fixture(scope="module")
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 45)), jnp.int32)


def test_segment_positions():
    seg = jnp.asarray([[3, 3, 3, 4, 4, 9], [1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


def test_packed_row_equals_its_segments_run_alone(model, ids):
    # Boundaries at 12 and 29: one inside a 16-token DeltaNet chunk, one a token past a chunk edge.
    lengths = [12, 17, 16]
    seg = jnp.asarray([np.repeat(np.arange(len(lengths)), lengths), np.full(45, 7)])
    packed = jax.jit(lambda m, x, s: m(x, segment_ids=s))(model, ids, seg)
    start = 0
    for n in lengths:
        alone = FWD(model, ids[:1, start : start + n])
        assert rel(packed[0, start : start + n], alone[0]) < 1e-4
        start += n
    # One segment covering the row is the plain forward.
    assert rel(packed[1], FWD(model, ids[1:])[0]) < 1e-4


def test_packed_gradients_equal_separate_gradients(model, ids):
    from flax import nnx

    graphdef, params = nnx.split(model, nnx.Param)
    n = 22  # two equal halves: the separate gradients share one compile
    seg = jnp.asarray([[0] * n + [1] * n])

    def loss(p, x, s=None):
        return jnp.sum(nnx.merge(graphdef, p)(x, segment_ids=s) ** 2)

    grad = jax.jit(jax.grad(loss))
    g_packed = grad(params, ids[:1, : 2 * n], seg)
    g_a = grad(params, ids[:1, :n])
    g_b = grad(params, ids[:1, n : 2 * n])
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    # Measured 6.0e-6 on these 5 layers; 1.21e-4 on 9 layers of the default pattern, where each
    # side was itself that far from a float64 run of the same weights (packed 1.30e-4, separate
    # 8.2e-5; the decay parameters A_log and dt_bias lead), so 1e-4 is the float32 floor with room;
    # ignoring the boundary (no segment ids) gives 0.94.
    assert rel(flat(g_packed), flat(g_a) + flat(g_b)) < 1e-4


def test_prefill_then_decode_reproduces_the_full_forward(model, ids):
    full = FWD(model, ids)
    step = STEP
    cache = model.init_cache(batch=2, max_len=64)
    logits, cache = step(model, ids[:, :29], cache)  # prefill (spans chunk boundaries)
    outs = [logits]
    for t in range(29, 45):  # token-by-token decode: the recurrent DeltaNet step, the KV cache
        logits, cache = step(model, ids[:, t : t + 1], cache)
        outs.append(logits)
    decoded = jnp.concatenate(outs, axis=1)
    assert rel(decoded, full) < 1e-4
    np.testing.assert_array_equal(cache["lengths"], [45, 45])


def test_decode_rows_with_different_lengths(model, ids):
    # Row 0 was prefilled with 10 tokens, row 1 with 20 (each alone); one decode step continues both.
    step = STEP
    rows = []
    for b, n in enumerate((10, 20)):
        c = model.init_cache(batch=1, max_len=32)
        _, c = step(model, ids[b : b + 1, :n], c)
        rows.append(c)
    cache = concat_cache_rows(rows)
    nxt = jnp.stack([ids[0, 10:11], ids[1, 20:21]])
    logits, cache = step(model, nxt, cache)
    assert rel(logits[0, 0], FWD(model, ids[:1, :11])[0, -1]) < 1e-4
    assert rel(logits[1, 0], FWD(model, ids[1:, :21])[0, -1]) < 1e-4
    np.testing.assert_array_equal(cache["lengths"], [11, 21])


@settings(max_examples=4, deadline=None, derandomize=True)
@given(held=st.sampled_from([0, 7, 13]), t=st.sampled_from([2, 5, RECURRENT_PREFILL_MAX]))
def test_a_short_prefill_continues_the_cache_as_the_full_forward(model, ids, held, t):
    """A prefill chunk of at most `RECURRENT_PREFILL_MAX` tokens runs the DeltaNet rule token by
    token from the state the cache holds; its logits are those of one uncached forward."""
    cache = model.init_cache(batch=2, max_len=64)
    if held:
        _, cache = STEP(model, ids[:, :held], cache)
    logits, cache = STEP(model, ids[:, held : held + t], cache)
    assert rel(logits, FWD(model, ids[:, : held + t])[:, held:]) < 1e-4
    np.testing.assert_array_equal(cache["lengths"], [held + t] * 2)


def test_segments_and_cache_do_not_mix(model, ids):
    with pytest.raises(ValueError, match="segment_ids"):
        model(ids, segment_ids=jnp.zeros_like(ids), cache=model.init_cache(2, 64))


MASKED = jax.jit(lambda m, x, c, a: m(x, cache=c, active=a))


def cache_row(cache, b):
    """Row b of every cache array (the batch axis follows the stacked-group axis in "groups")."""
    return {
        "groups": jax.tree.map(lambda a: a[:, b], cache["groups"]),
        "tail": jax.tree.map(lambda a: a[b], cache["tail"]),
    }


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 28), min_size=3, max_size=3),
    t=st.sampled_from([1, 4]),
    mask=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_rows_outside_active_keep_their_cache_exactly(model, ids, lengths, t, mask):
    """A masked call leaves the other rows' cache bit for bit (a row full up to max_len too, where
    the attention write would be clamped back onto filled slots), and each active row continues
    as it would alone."""
    max_len = 32
    rows = []
    for b, n in enumerate(lengths):
        c = model.init_cache(batch=1, max_len=max_len)
        if n:
            _, c = STEP(model, ids[b % 2 : b % 2 + 1, :n], c)
        rows.append(c)
    cache = concat_cache_rows(rows)
    tokens = jnp.stack([ids[b % 2, 30 : 30 + t] for b in range(3)])
    active = jnp.asarray(mask)
    logits, new = MASKED(model, tokens, cache, active)
    for b, (n, on) in enumerate(zip(lengths, mask, strict=True)):
        got, was = cache_row(new, b), cache_row(cache, b)
        if not on:
            jax.tree.map(np.testing.assert_array_equal, got, was)
            assert int(new["lengths"][b]) == n
        else:
            alone_logits, alone = STEP(model, tokens[b : b + 1], rows[b])
            assert int(new["lengths"][b]) == n + t
            assert rel(logits[b], alone_logits[0]) < 1e-5
            np.testing.assert_allclose(new["tail"][0]["state"][b], alone["tail"][0]["state"][0], atol=1e-6)
