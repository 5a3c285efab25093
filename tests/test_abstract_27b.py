"""The real Qwen3.5-27B shape, exercised abstractly: nothing is allocated."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi import QWEN3_5_27B, Qwen3_5ForCausalLM
from jaxpi.convert.table import text_rules
from jaxpi.models.qwen3_5 import layer_plan

# 26,895,998,464 text-model parameters: the "27B" of the model name less the vision tower.
TEXT_PARAMS_27B = 26_895_998_464


def abstract_model():
    return nnx.eval_shape(lambda: Qwen3_5ForCausalLM(QWEN3_5_27B, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


def test_27b_parameter_count_and_table_agree():
    model = abstract_model()
    state = nnx.state(model, nnx.Param)
    ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    hf = sum(int(np.prod(r.hf_shape)) for r in text_rules(QWEN3_5_27B, "model.language_model."))
    assert ours == hf == TEXT_PARAMS_27B
    assert layer_plan(QWEN3_5_27B) == (4, 16)  # 16 scanned groups of (DeltaNet x3, attention)


def test_27b_params_carry_logical_axes():
    state = nnx.state(abstract_model(), nnx.Param)
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == len(var.get_value().shape), path
        if path[0] == "groups":
            assert axes[0] == "layers" and var.get_value().shape[0] == 16, path
    q = state["groups"]["blocks"][3]["mixer"]["q_proj"]
    assert q.get_value().shape == (16, 5120, 24, 512)
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "q_heads", "head_dim")


def test_27b_forward_and_backward_compile_ahead_of_time():
    model = abstract_model()
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jax.ShapeDtypeStruct((1, 64), jnp.int32)

    def loss(p, ids):
        logits = nnx.merge(graphdef, p)(ids)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    out_loss, out_grads = compiled.out_info
    assert out_loss.shape == ()
    assert jax.tree.map(lambda a: a.shape, out_grads) == jax.tree.map(lambda a: a.shape, params)
