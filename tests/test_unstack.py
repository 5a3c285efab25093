"""`jaxpi.models.unstack`: the scanned model with every layer in the tail computes the same
logits, carries its adapters (and a partly selected stack's masks) along, and `unstack_state`
puts a scanned-layout state on the unstacked paths; the engine runs either layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import TINY
from jaxpi.hf_fixtures import random_jax_model
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import layer_plan
from jaxpi.models.unstack import unstack_layers, unstack_state
from jaxpi.rollout import JaxEngine, SamplingParams

CFG = TINY.replace(num_hidden_layers=9)  # two scanned groups of 4 and a tail of 1


@pytest.fixture(scope="module")
def model():
    m = random_jax_model(CFG, 3, "float32")
    # layers 0, 5 and 8: each group partly selected (a per-group mask), and the tail layer
    add_lora(m, LoraConfig(rank=4, alpha=8.0, layers=(0, 5, 8)))
    rng = np.random.default_rng(1)
    state = nnx.state(m, LoRAParam)
    nnx.update(m, jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), state))
    return m


def test_unstacked_model_computes_the_same_logits(model):
    assert layer_plan(model.cfg) == (4, 2)
    flat = unstack_layers(model)
    assert flat.groups is None and len(flat.tail) == 9 and not flat.cfg.scan_layers
    assert model.groups is not None and len(model.tail) == 1  # the source is left as it was
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 11)))
    fwd = jax.jit(lambda m, x: m(x))
    np.testing.assert_allclose(fwd(flat, ids), fwd(model, ids), atol=3e-6, rtol=0)
    # layer 4 (group 1, position 0) is not adapted: its slice of the stacked mask is 0
    masks = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(flat)) if "lora_mask" in str(p[-1])}
    assert masks and all(v.shape == () for v in masks.values())
    assert {p[1] for p, v in masks.items() if v == 0} == {4, 1} and {
        p[1] for p, v in masks.items() if v == 1
    } == {0, 5}
    # logical axes lose the stacked one with it
    var = flat.tail[2].mlp.up_proj
    assert var.get_value().ndim == 2 and var.get_metadata()["out_sharding"] == ("embed", "mlp")


def test_unstack_state_maps_paths_and_slices(model):
    flat = unstack_layers(model)
    got = dict(nnx.to_flat_state(unstack_state(model.cfg, nnx.state(model, LoRAParam))))
    want = dict(nnx.to_flat_state(nnx.state(flat, LoRAParam)))
    assert set(got) == set(want) and any(p[1] == 8 for p in got)  # the tail layer moves to 8
    for path in want:
        np.testing.assert_array_equal(got[path].get_value(), want[path].get_value())
    unscanned = random_jax_model(CFG.replace(scan_layers=False), 0, "float32")
    assert unstack_layers(unscanned) is unscanned
    assert unstack_state(unscanned.cfg, nnx.state(unscanned)) is not None


def test_engine_layouts_agree_and_take_scanned_updates(model):
    prompts = [[5, 9, 1, 30], [7, 2]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    on = JaxEngine(model, max_len=16, batch_size=2, prefill_chunks=(4, 1), unstack=True)
    off = JaxEngine(model, max_len=16, batch_size=2, prefill_chunks=(4, 1), unstack=False)
    assert on.unstacked and not off.unstacked and "groups" not in on._cache and "groups" in off._cache
    a, b = on.generate(prompts, greedy), off.generate(prompts, greedy)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    np.testing.assert_allclose([c.logprobs for c in a], [c.logprobs for c in b], atol=1e-5)
    # new adapters in the trainer's (scanned) layout reach the unstacked engine
    state = nnx.state(model, LoRAParam)
    moved = jax.tree.map(lambda x: x * 3.0, state)
    on.update_weights(moved)
    off.update_weights(moved)
    a2, b2 = on.generate(prompts, greedy), off.generate(prompts, greedy)
    assert [c.logprobs for c in a2] != [c.logprobs for c in a]
    np.testing.assert_allclose([c.logprobs for c in a2], [c.logprobs for c in b2], atol=1e-5)
