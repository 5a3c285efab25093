"""Training checkpoints: orbax round trip, atomicity (unfinished saves never count), load_adapter."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi.config import TINY
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.train.checkpoint import (
    CheckpointStore,
    complete_steps,
    flat_arrays,
    load_adapter,
    resolve_step_dir,
)
from jaxpi.train.schedule import OptimConfig, make_optimizer

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "in_proj_qkv", "down_proj"))


def abstract_lora_model(seed: int = 0):
    """TINY with adapters, built abstractly (running the initialisers eagerly is slow on CPU)."""
    return nnx.eval_shape(lambda: add_lora(Qwen3_5ForCausalLM(TINY, rngs=nnx.Rngs(seed)), LORA))


@pytest.fixture(scope="module")
def state():
    adapter = nnx.state(abstract_lora_model(), LoRAParam)
    # Noise in A and B (and so in the optimizer moments): a restore that zeroed anything would show.
    rng = np.random.default_rng(2)
    adapter = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), adapter)
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    opt_state = optimizer.init(adapter)
    grads = jax.tree.map(jnp.ones_like, adapter)
    _, opt_state = optimizer.update(grads, opt_state, adapter)
    meta = {
        "base": "/some/base",
        "model_config": TINY.to_hf(),
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(LORA.targets)},
        "config": {"note": "test"},
    }
    return adapter, opt_state, meta


def save_steps(run_dir, state, steps, keep=3):
    adapter, opt_state, meta = state
    store = CheckpointStore(run_dir, keep=keep)
    for s in steps:
        store.save(s, adapter, opt_state, {"step": s, "data": {"pos": s}}, {**meta, "step": s})
    return store


def test_round_trip_keeps_every_array_bit_for_bit(tmp_path, state):
    adapter, opt_state, _ = state
    store = save_steps(tmp_path, state, [1, 2, 3, 4], keep=2)
    assert store.complete_steps() == [3, 4]  # keep the last K
    # Orbax's layout: each step has its metadata and commit marker, and no temporary remains.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["3", "4"]
    assert (tmp_path / "checkpoints" / "4" / "commit_success.txt").exists()
    target_opt = jax.tree.map(jnp.zeros_like, opt_state)
    got = store.restore(4, jax.tree.map(jnp.zeros_like, adapter), target_opt)
    for (name, a), (_, b) in zip(flat_arrays(got.adapter).items(), flat_arrays(adapter).items(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert a.dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(opt_state)
    assert got.trainer == {"step": 4, "data": {"pos": 4}} and got.meta["step"] == 4
    store.close()


def test_unfinished_saves_are_never_picked_up(tmp_path, state):
    store = save_steps(tmp_path, state, [2])
    store.close()
    ckpts = tmp_path / "checkpoints"
    # What a save killed half-way leaves: orbax's temporary directory (items partly written).
    tmp = ckpts / "5.orbax-checkpoint-tmp-1732900000000000"
    (tmp / "adapter").mkdir(parents=True)
    (tmp / "adapter" / "partial").write_bytes(b"\0" * 10)
    # And a step directory that no finished save produced (e.g. a copy cut short): no metadata.
    (ckpts / "7" / "adapter").mkdir(parents=True)
    # Orbax itself never lists its temporary directory as a step...
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(ckpts, options=ocp.CheckpointManagerOptions(read_only=True))
    assert 5 not in manager.all_steps()
    manager.close()
    # ...and ours also refuses the bare step directory, and removes the temporary one on start.
    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint .*7"):
        assert complete_steps(ckpts) == [2]
    with pytest.warns(UserWarning):
        store = CheckpointStore(tmp_path)
        assert store.latest_step() == 2
    assert not tmp.exists()
    with pytest.warns(UserWarning):
        assert resolve_step_dir(tmp_path) == ckpts / "2"
    store.close()


def test_load_adapter_round_trip(tmp_path, state):
    adapter, _, meta = state
    save_steps(tmp_path, state, [3, 6]).close()
    for path, step in ((tmp_path, 6), (tmp_path / "checkpoints", 6), (tmp_path / "checkpoints" / "3", 3)):
        got, lora_cfg, got_meta = load_adapter(path)
        assert got_meta["step"] == step and got_meta["base"] == meta["base"]
        assert got_meta["model_config"] == json.loads(json.dumps(TINY.to_hf()))
        assert (lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets) == (LORA.rank, LORA.alpha, LORA.targets)
        # The structure add_lora gives the model, so nnx.update can put it in place.
        want = nnx.state(abstract_lora_model(seed=5), LoRAParam)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for (p, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(adapter), strict=True):
            np.testing.assert_array_equal(
                np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p)
            )
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_adapter(tmp_path / "nowhere")
    # A path relative to the working directory (`jaxpi export --adapter runs/x`) works too.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path.parent)
        assert load_adapter(Path(tmp_path.name) / "checkpoints" / "3")[2]["step"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_adapter(empty)


def test_a_save_that_fails_half_way_leaves_only_orbax_temporary(tmp_path, state):
    adapter, opt_state, meta = state
    store = save_steps(tmp_path, state, [1])
    # The trainer item cannot be written: the adapter and optimizer items of step 2 may be on
    # disk already, but the step never appears.
    with pytest.raises(TypeError, match="not JSON serializable"):
        store.save(2, adapter, opt_state, {"step": object()}, meta)
    store.close()
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left[0] == "1" and len(left) == 2 and left[1].startswith("2.orbax-checkpoint-tmp")
    store = CheckpointStore(tmp_path)  # the next start removes the leftover
    assert store.complete_steps() == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    store.close()
