"""`pad_token_id`: the embedding row transformers builds with `nn.Embedding(padding_idx=pad)`.

Its lookups pass no gradient to the table, so a full fine-tune leaves the row as it was (and a
fresh HF init keeps it zero); a tied LM head still trains it through the logits, as in torch.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpi.config import LINEAR, TINY
from jaxpi.hf_fixtures import random_jax_model
from jaxpi.train.step import make_train_step

PAD = 3
CFG = TINY.replace(num_hidden_layers=1, layer_types=(LINEAR,))


def embed_grad(cfg) -> np.ndarray:
    model = random_jax_model(cfg, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))).at[:, ::5].set(PAD)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(ids)
        return -jnp.mean(jax.nn.log_softmax(logits[:, :-1]).max(-1))

    return np.asarray(jax.grad(loss)(params)["embed"].get_value())


@pytest.fixture(scope="module")
def grads():
    return {
        "none": embed_grad(CFG),
        "pad": embed_grad(CFG.replace(pad_token_id=PAD)),
        "pad-tied": embed_grad(CFG.replace(pad_token_id=PAD, tie_word_embeddings=True)),
        "tied": embed_grad(CFG.replace(tie_word_embeddings=True)),
    }


def test_pad_row_gets_no_gradient_from_its_lookups(grads):
    assert np.any(grads["none"][PAD])  # the pad id is among the tokens
    assert not np.any(grads["pad"][PAD])
    others = np.arange(CFG.vocab_size) != PAD
    np.testing.assert_array_equal(grads["pad"][others], grads["none"][others])


def test_tied_head_still_trains_the_pad_row(grads):
    # tied: the pad row loses its lookups' share only; the LM head's share still trains it
    assert np.any(grads["pad-tied"][PAD])
    assert not np.allclose(grads["pad-tied"][PAD], grads["tied"][PAD])
    others = np.arange(CFG.vocab_size) != PAD
    np.testing.assert_array_equal(grads["pad-tied"][others], grads["tied"][others])


def test_full_fine_tune_leaves_the_pad_row_as_it_was():
    cfg = CFG.replace(pad_token_id=PAD)
    model = random_jax_model(cfg, seed=1)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adam(1e-2)
    step = jax.jit(make_train_step(graphdef, optimizer, trainable=nnx.Param))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))).at[:, ::3].set(PAD)
    before = np.asarray(params["embed"].get_value())
    new, _, metrics = step(params, optimizer.init(params), {"input_ids": ids})
    after = np.asarray(new["embed"].get_value())
    assert np.isfinite(float(metrics["loss"]))
    np.testing.assert_array_equal(after[PAD], before[PAD])
    seen = np.unique(np.asarray(ids))
    assert np.all(np.any(after[seen[seen != PAD]] != before[seen[seen != PAD]], axis=-1))
