"""LoRA on every linear layer: identity at init, merge == unmerged forward, trainable state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import QWEN3_5_27B, TINY, Qwen3_5ForCausalLM
from jaxpi.convert.table import text_rules
from jaxpi.lora import ALL_LINEAR, LoraConfig, LoRAParam, add_lora, merge_lora

CFG = TINY.replace(num_hidden_layers=9)  # scanned groups and an unrolled tail both get adapters
FWD = jax.jit(lambda m, x: m(x))


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)), jnp.int32)


def randomize_b(model, scale=0.05):
    state = nnx.state(model, LoRAParam)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        if str(path[-1]).startswith("lora_b_"):
            var.set_value(scale * jax.random.normal(jax.random.key(i), var.get_value().shape))
    nnx.update(model, state)


def test_fresh_adapter_is_the_identity_and_merge_equals_unmerged(ids):
    model = Qwen3_5ForCausalLM(CFG, rngs=nnx.Rngs(0))
    base = FWD(model, ids)
    add_lora(model, LoraConfig(rank=4, alpha=8.0))
    np.testing.assert_array_equal(FWD(model, ids), base)  # B = 0
    randomize_b(model)
    adapted = FWD(model, ids)
    assert rel(adapted, base) > 1e-2
    merge_lora(model)
    assert not jax.tree.leaves(nnx.state(model, LoRAParam))
    assert rel(FWD(model, ids), adapted) < 1e-5


def test_every_linear_layer_gets_an_adapter_with_logical_axes():
    model = add_lora(Qwen3_5ForCausalLM(CFG, rngs=nnx.Rngs(0)), LoraConfig(rank=4))
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    for hf in ALL_LINEAR:
        assert f"lora_a_{hf}" in names, hf
    assert {"lora_b_q_proj", "lora_b_k_proj", "lora_b_v_proj", "lora_b_z_proj", "lora_b_out_proj"} <= names
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.get_value().ndim and "lora_rank" in axes, path
        assert var.get_value().dtype == jnp.float32
        assert (axes[0] == "layers") == (path[0] == "groups"), path


def test_gradients_reach_only_the_adapters(ids):
    model = add_lora(
        Qwen3_5ForCausalLM(CFG, rngs=nnx.Rngs(0)), LoraConfig(rank=2, targets=("q_proj", "in_proj_qkv"))
    )
    randomize_b(model)
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        return jnp.mean(nnx.merge(graphdef, lora, rest)(ids) ** 2)

    grads = jax.grad(loss)(lora)
    flat = {str(p[-1]): v.get_value() for p, v in nnx.to_flat_state(grads)}
    assert set(flat) == {
        "lora_a_q_proj",
        "lora_b_q_proj",
        "lora_a_in_proj_qkv",
        "lora_b_k_proj",
        "lora_b_v_proj",
    }
    assert all(float(jnp.abs(g).max()) > 0 for g in flat.values())


@pytest.mark.parametrize("rank", [32, 64])
def test_27b_adapter_size_matches_peft_count(rank):
    def build():
        base = Qwen3_5ForCausalLM(QWEN3_5_27B, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return add_lora(base, LoraConfig(rank=rank))

    model = nnx.eval_shape(build)
    n_lora = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, LoRAParam)))
    n_base = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # peft's count: r * (in + out) for every targeted HF Linear [out, in] of every layer.
    linears = [
        r for r in text_rules(QWEN3_5_27B, "model.") if r.layer >= 0 and r.kind not in ("copy", "conv")
    ]
    assert n_lora == sum(rank * sum(r.hf_shape) for r in linears)
    assert n_base == 26_895_998_464
    print(f"rank {rank}: {n_lora:,} adapter parameters = {100 * n_lora / n_base:.2f}% of the base")
    assert n_lora / n_base < (0.01 if rank == 32 else 0.02)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"), ({"targets": ("qkv",)}, "unknown LoRA targets")],
)
def test_invalid_lora_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)
