"""The depthwise causal conv against transformers' torch reference (fp32, CPU)."""

import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

from jaxpi.kernels.conv import causal_conv1d

jax.config.update("jax_enable_x64", False)

TOL = 1e-5
TAPS, CHANNELS = 4, 12


def make_inputs(seed: int, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """x [B, T, C] and weight [K, C]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, length, CHANNELS)).astype(np.float32)
    return x, (rng.standard_normal((TAPS, CHANNELS)) / 2).astype(np.float32)


def rel_err(a, b) -> float:
    a, b = (np.asarray(t.detach() if isinstance(t, torch.Tensor) else t, np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


conv = jax.jit(causal_conv1d, static_argnames="activation")


@pytest.mark.parametrize("length", [37, 2])
@pytest.mark.parametrize("activation", [True, False])
def test_matches_hf_forward_and_backward(length: int, activation: bool):
    x, w = make_inputs(0, 2, length)
    cot = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(causal_conv1d(x, w, activation=activation)[0] * cot)

    out, state = conv(x, w, activation=activation)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    # transformers: x [B, C, T], weight [C, K]
    x_t = torch.tensor(x.transpose(0, 2, 1), requires_grad=True)
    w_t = torch.tensor(w.T, requires_grad=True)
    ref = causal_conv1d_fn(x_t, w_t, None, activation="silu" if activation else None)
    (ref * torch.from_numpy(cot.transpose(0, 2, 1))).sum().backward()

    assert rel_err(out, ref.permute(0, 2, 1)) <= TOL
    assert rel_err(dx, x_t.grad.permute(0, 2, 1)) <= 1e-4
    assert rel_err(dw, w_t.grad.T) <= 1e-4
    padded = np.concatenate([np.zeros((2, TAPS - 1, CHANNELS), np.float32), x], axis=1)
    np.testing.assert_array_equal(state, padded[:, -(TAPS - 1) :])


def test_state_carries_across_pieces():
    x, w = make_inputs(2, 2, 30)
    whole, whole_state = conv(x, w)
    first, state = conv(x[:, :11], w)
    second, state = conv(x[:, 11:13], w, state=state)  # shorter than K − 1
    third, state = conv(x[:, 13:], w, state=state)
    np.testing.assert_allclose(np.concatenate([first, second, third], axis=1), whole, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(state, whole_state)


def test_decode_steps_match_hf_update():
    x, w = make_inputs(3, 2, 9)
    initial = np.random.default_rng(4).standard_normal((2, TAPS - 1, CHANNELS)).astype(np.float32)
    hf_state = torch.from_numpy(initial.transpose(0, 2, 1).copy())  # [B, C, K−1], updated in place
    state = jnp.asarray(initial)
    for t in range(x.shape[1]):
        out, state = conv(x[:, t : t + 1], w, state=state)
        ref = causal_conv1d_update(
            torch.from_numpy(x[:, t : t + 1].transpose(0, 2, 1).copy()),
            hf_state,
            torch.from_numpy(w.T.copy()),
            None,
            "silu",
        )
        assert rel_err(out, ref.permute(0, 2, 1)) <= TOL
        np.testing.assert_array_equal(state, hf_state.permute(0, 2, 1))


def test_segments_equal_separate_runs():
    """Segments (lengths 10, 2, 13) see only themselves; the incoming state feeds only the first."""
    x, w = make_inputs(5, 1, 25)
    lengths = (10, 2, 13)
    segment_ids = np.repeat(np.array([[0, 1, 0]], np.int32), lengths, axis=1)  # ids may repeat
    initial = np.random.default_rng(6).standard_normal((1, TAPS - 1, CHANNELS)).astype(np.float32)
    out, state = conv(x, w, segment_ids=segment_ids, state=initial)

    bounds = itertools.pairwise(np.cumsum((0, *lengths)))
    pieces = [conv(x[:, a:b], w, state=initial if i == 0 else None) for i, (a, b) in enumerate(bounds)]
    np.testing.assert_allclose(out, np.concatenate([p[0] for p in pieces], axis=1), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(state, pieces[-1][1])

    short_last, short_state = conv(x[:, :12], w, segment_ids=segment_ids[:, :12], state=initial)
    np.testing.assert_array_equal(short_state, pieces[1][1])  # a last segment shorter than K − 1
    np.testing.assert_allclose(short_last[:, 10:], pieces[1][0], rtol=0, atol=1e-6)
