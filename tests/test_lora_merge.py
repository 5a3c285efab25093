"""LoRA as a tree transform: the pure merge (`merged_params`) against the in-place one
(`merge_lora`) and a float64 reference, merge then unmerge back to W within one rounding, and the
adapter slots `project` reads (`jaxpi.models.adapters`).

Random adapters (A and B both random, masked groups included) on tiny models read from
checkpoints written by `transformers`; hypothesis draws the rank, alpha, selected layers, dtype
and seed (fixed seed, a bounded number of examples).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi import TINY, load_hf
from jaxpi.config import FULL, LINEAR
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.lora import (
    ADAPTER,
    TARGETS,
    LoraConfig,
    LoRAParam,
    add_lora,
    lora_deltas,
    merge_lora,
    merged_params,
    unmerge_lora,
    unmerged_params,
)
from jaxpi.models.adapters import a_name, adapter_for, b_name, mask_name, parse_slot
from jaxpi.models.layers import project

# Five layers of period 2: groups (0,1) and (2,3) scanned, layer 4 in the tail.
SMALL = TINY.replace(num_hidden_layers=5, layer_types=(LINEAR, FULL, LINEAR, FULL, LINEAR))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """`base(dtype)`: a fresh SMALL model in that dtype, from one checkpoint."""
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), SMALL, seed=5)
    return lambda dtype: load_hf(path, dtype=dtype)[1]


def random_adapters(model, seed: int) -> None:
    """A and B random everywhere (also the rows of unselected groups, which the masks must zero)."""
    state = nnx.state(model, LoRAParam)
    for i, (_, var) in enumerate(nnx.to_flat_state(state)):
        key = jax.random.fold_in(jax.random.key(seed), i)
        var.set_value(0.1 * jax.random.normal(key, var.get_value().shape))
    nnx.update(model, state)


def flat(state) -> dict:
    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def reference_deltas(lora: dict, scale: float, shapes: dict, absolute: bool = False) -> dict:
    """s·mask ⊙ (A·B) in float64 with numpy, straight from the slot names (`absolute`: of |A|, |B|,
    the size of the float32 product's rounding error)."""
    out = {}
    for path, a in lora.items():
        slot = parse_slot(str(path[-1]))
        if slot is None or slot[0] != "a":
            continue
        module, hf = path[:-1], slot[1]
        for proj in TARGETS[hf][1]:
            b = lora[(*module, b_name(proj))].astype(np.float64)
            b = np.abs(b) if absolute else b
            shape = shapes[(*module, proj)]
            stacked = module[0] == "groups"
            lead = a.shape[:1] if stacked else ()
            a2 = (np.abs(a) if absolute else a).astype(np.float64).reshape(*lead, -1, a.shape[-1])
            d = scale * np.matmul(a2, b.reshape(*b.shape[: len(lead) + 1], -1))
            mask = lora.get((*module, mask_name(hf)))
            if mask is not None:
                d = d * mask.reshape(-1, 1, 1)
            out[(*module, proj)] = d.reshape(shape)
    return out


@fixed_seed(24)
@settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    rank=st.integers(1, 4),
    alpha=st.sampled_from([1.0, 4.0, 7.5]),
    layers=st.sets(st.integers(0, 4), min_size=1).map(sorted),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**16),
)
def test_pure_merge_equals_in_place_merge_and_unmerge_inverts_it(base, rank, alpha, layers, dtype, seed):
    lcfg = LoraConfig(rank=rank, alpha=alpha, layers=tuple(layers))
    model = add_lora(base(dtype), lcfg, key=jax.random.key(seed))
    random_adapters(model, seed)
    params, lora = nnx.state(model, nnx.Param), nnx.state(model, ADAPTER)
    w = flat(params)

    pure = merged_params(params, lora, lcfg)
    assert all(np.array_equal(v, w[p]) for p, v in flat(params).items())  # inputs untouched
    got = flat(pure)
    assert set(got) == set(w)

    # In place, adapters dropped, and in place keeping them: the same bits.
    for keep in (False, True):
        other = merge_lora(nnx.clone(model), keep_adapters=keep)
        for p, v in flat(nnx.state(other, nnx.Param)).items():
            np.testing.assert_array_equal(v, got[p], err_msg=str(p))

    # Against float64: one rounding to W's dtype of W + s·mask ⊙ (A·B).
    shapes = {p: v.shape for p, v in w.items()}
    ref = reference_deltas(flat(lora), lcfg.scale, shapes)
    assert ref and set(ref) == set(lora_deltas(lora, lcfg, shapes))
    size = reference_deltas(flat(lora), lcfg.scale, shapes, absolute=True)
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    slack = {p: (rank + 2) * float(jnp.finfo(jnp.float32).eps) * v for p, v in size.items()}  # A·B in f32
    for p, v in got.items():
        w64 = w[p].astype(np.float64)
        d = ref.get(p, 0.0)
        bound = eps / 2 * np.abs(w64 + d) + slack.get(p, 0.0)
        assert np.all(np.abs(v.astype(np.float64) - (w64 + d)) <= bound), p
        if p not in ref:
            np.testing.assert_array_equal(v, w[p])  # not adapted: the same array

    # Unmerge: back to W within one rounding (the pure inverse and the in-place one agree).
    back = flat(unmerged_params(pure, lora, lcfg.scale))
    for p, v in back.items():
        w64, d = w[p].astype(np.float64), np.abs(ref.get(p, 0.0))
        bound = eps / 2 * (2 * np.abs(w64) + d) + 2 * slack.get(p, 0.0)
        assert np.all(np.abs(v.astype(np.float64) - w64) <= bound), p
    twice = unmerge_lora(merge_lora(nnx.clone(model), keep_adapters=True))
    for p, v in flat(nnx.state(twice, nnx.Param)).items():
        np.testing.assert_array_equal(v, back[p], err_msg=str(p))


def test_project_adds_the_adapter_it_finds_in_the_slots(base):
    """`project` = einsum + s·(x·A)·B through `adapter_for`; nothing without an adapter or when
    merged, and the mask of an unselected group zeroes it."""
    model = add_lora(base("float32"), LoraConfig(rank=3, alpha=6.0, layers=(1, 4)))
    random_adapters(model, 0)
    mlp = model.tail[0].mlp
    x = jax.random.normal(jax.random.key(1), (2, 3, SMALL.hidden_size))
    plain = jnp.einsum("btd,df->btf", x, mlp.up_proj[...])
    adapter = adapter_for(mlp, "up_proj")
    assert adapter is not None and adapter.mask is None and adapter.scale == 2.0 and not adapter.merged
    want = plain + 2.0 * (x @ getattr(mlp, a_name("up_proj"))[...]) @ getattr(mlp, b_name("up_proj"))[...]
    got = project(mlp, "up_proj", x, "btd,df->btf")
    assert float(jnp.abs(got - plain).max()) > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    merge_lora(model, keep_adapters=True)
    assert adapter_for(mlp, "up_proj").merged
    np.testing.assert_allclose(project(mlp, "up_proj", x, "btd,df->btf"), want, rtol=1e-5, atol=1e-5)
    merge_lora(unmerge_lora(model))
    assert adapter_for(mlp, "up_proj") is None
    np.testing.assert_array_equal(
        project(mlp, "up_proj", x, "btd,df->btf"), jnp.einsum("btd,df->btf", x, mlp.up_proj[...])
    )


def test_slot_names_are_the_state_paths():
    assert (a_name("in_proj_qkv"), b_name("q_proj"), mask_name("up_proj")) == (
        "lora_a_in_proj_qkv",
        "lora_b_q_proj",
        "lora_mask_up_proj",
    )
    assert parse_slot("lora_a_in_proj_qkv") == ("a", "in_proj_qkv")
    assert parse_slot("lora_b_q_proj") == ("b", "q_proj")
    assert parse_slot("lora_mask_up_proj") == ("mask", "up_proj")
    assert parse_slot("q_proj") is None
