"""The chunked LM head (`loss_chunk`): the same log-probabilities and gradients as the whole head,
and the `[B, T, V]` logits never held at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import TINY
from jaxpi.hf_fixtures import random_jax_model, seeded_noise
from jaxpi.kernels.lm_head import target_logprobs
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.rl.loss import sequence_logprobs
from jaxpi.train.base import ModelConfig
from jaxpi.train.step import next_token_loss


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_chunks_equal_the_whole_head():
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 37, 64, 512  # T not a multiple of the chunk: the last chunk is padded
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal((d, v)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, (b, t)))
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    ref = np.take_along_axis(z, np.asarray(tg)[..., None], -1)[..., 0] - np.log(np.exp(z).sum(-1))
    cot = jnp.asarray(rng.standard_normal((b, t)), jnp.float32)

    def grads(chunk: int):
        return jax.grad(lambda h, w: jnp.sum(target_logprobs(h, w, tg, chunk=chunk) * cot), argnums=(0, 1))(
            h, w
        )

    whole = grads(0)
    for chunk in (16, 5):
        got = target_logprobs(h, w, tg, chunk=chunk)
        assert got.shape == (b, t) and np.abs(np.asarray(got) - ref).max() < 1e-5
        np.testing.assert_array_equal(got, target_logprobs(h, w, tg))  # row by row the same ops
        for name, g, want in zip(("hidden", "lm_head"), grads(chunk), whole, strict=True):
            assert rel_err(g, want) < 1e-6, name
    with pytest.raises(ValueError, match="do not fit"):
        target_logprobs(h, w[:, :10].T, tg)
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        target_logprobs(h, w, tg, chunk=-1)


def test_chunked_gradient_never_holds_the_whole_logits():
    """XLA's buffer assignment of the compiled gradient: the whole head needs the [T, V] float32
    logits (and their gradient); chunks of 128 need a fraction of one such array."""
    t, d, v = 1024, 64, 8192
    logits_bytes = t * v * 4
    args = (
        jax.ShapeDtypeStruct((1, t, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((1, t), jnp.int32),
    )
    temp = {}
    for chunk in (0, 128):
        fn = jax.grad(lambda h, w, tg, c=chunk: jnp.sum(target_logprobs(h, w, tg, chunk=c)), argnums=(0, 1))
        temp[chunk] = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    # measured: 64.0 MiB whole, 10.3 MiB in chunks of 128 (32 MiB per [T, V] float32 array)
    assert temp[0] >= logits_bytes
    assert temp[128] < logits_bytes / 2


@pytest.fixture(scope="module")
def models():
    """One DeltaNet layer of TINY with adapters (non-zero B), as is and with loss_chunk 16 (the
    depth does not matter here: the chunking is all after the last layer)."""
    out = {}
    for chunk in (0, 16):
        m = random_jax_model(TINY.replace(num_hidden_layers=1, loss_chunk=chunk))
        add_lora(m, LoraConfig(rank=4, alpha=8.0), key=jax.random.key(1))
        # B non-zero: the same seeded noise as every other weight (no per-shape RNG compiles)
        nnx.update(m, seeded_noise(nnx.state(m, LoRAParam), seed=1))
        out[chunk] = m
    return out


def test_losses_through_the_model_equal_with_chunks(models):
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 40)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 2, 0), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (2, 40)), jnp.int32)

    def run(model):
        graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

        @jax.jit
        def both(lora, rest):
            def loss(lora):
                return next_token_loss(nnx.merge(graphdef, lora, rest), ids, loss_mask=mask, segment_ids=seg)

            value, grads = jax.value_and_grad(loss)(lora)
            return value, grads, sequence_logprobs(nnx.merge(graphdef, lora, rest), ids, seg)

        value, grads, lp = both(lora, rest)
        return float(value), jax.tree.leaves(grads), lp

    (v0, g0, lp0), (v1, g1, lp1) = run(models[0]), run(models[16])
    assert v1 == pytest.approx(v0, rel=1e-6)
    assert len(g1) == len(g0) > 0
    for got, want in zip(g1, g0, strict=True):
        assert rel_err(got, want) < 1e-5
    assert lp1.shape == (2, 40) and float(jnp.abs(lp1 - lp0).max()) < 1e-5


def test_loss_chunk_is_validated_and_reaches_the_model_config():
    with pytest.raises(ValueError, match="loss_chunk"):
        TINY.replace(loss_chunk=-1)
    with pytest.raises(ValueError, match=r"model\.loss_chunk"):
        ModelConfig(loss_chunk=-8)
    assert ModelConfig(loss_chunk=1024).overrides()["loss_chunk"] == 1024
