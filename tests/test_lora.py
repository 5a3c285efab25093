"""LoRA: identity at init, merge / unmerge, trainable state, dropout, layer and regex selection.

Models come from tiny random checkpoints written by `transformers` and read with `load_hf` (far
cheaper on the CPU than initialising the jaxpi model op by op).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import QWEN3_5_27B, TINY, load_hf
from jaxpi.config import FULL, LINEAR
from jaxpi.convert.table import text_rules
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.lora import (
    ALL_LINEAR,
    LoraConfig,
    LoRAMask,
    LoRAParam,
    adapter_module,
    add_lora,
    merge_lora,
    module_paths,
    select_modules,
    unmerge_lora,
)
from jaxpi.models.layers import project
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

CFG = TINY.replace(num_hidden_layers=9)  # scanned groups and an unrolled tail both get adapters
# Five layers of period 2: groups (0,1) and (2,3) scanned, layer 4 in the tail.
SMALL = TINY.replace(num_hidden_layers=5, layer_types=(LINEAR, FULL, LINEAR, FULL, LINEAR))
PAIR = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))  # one layer of each kind
FWD = jax.jit(lambda m, x: m(x))
FWD_KEY = jax.jit(lambda m, x, k: m(x, dropout_key=k))


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """`base(cfg)`: a fresh jaxpi model of that config (one checkpoint written per config)."""
    dirs = {}

    def get(cfg):
        if cfg not in dirs:
            dirs[cfg] = make_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, seed=len(dirs))
        return load_hf(dirs[cfg])[1]

    get.dirs = dirs  # the checkpoint of each config, for the torch side
    return get


@pytest.fixture
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)), jnp.int32)


def randomize_b(model, scale=0.05):
    """Random B on selected layers (rows of unselected layers in stacked adapters stay zero)."""
    state = nnx.state(model, LoRAParam)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        if str(path[-1]).startswith("lora_b_"):
            var.set_value(scale * jax.random.normal(jax.random.key(i), var.get_value().shape))
    nnx.update(model, state)


def test_fresh_adapter_is_the_identity_and_merge_equals_unmerged(base, ids):
    model = base(SMALL)
    base_logits = FWD(model, ids)
    add_lora(model, LoraConfig(rank=4, alpha=8.0))
    np.testing.assert_array_equal(FWD(model, ids), base_logits)  # B = 0
    randomize_b(model)
    adapted = FWD(model, ids)
    assert rel(adapted, base_logits) > 1e-2
    merge_lora(model)
    assert not jax.tree.leaves(nnx.state(model, LoRAParam))
    assert rel(FWD(model, ids), adapted) < 1e-5


def test_every_linear_layer_gets_an_adapter_with_logical_axes():
    model = nnx.eval_shape(lambda: add_lora(Qwen3_5ForCausalLM(CFG, rngs=nnx.Rngs(0)), LoraConfig(rank=4)))
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    for hf in ALL_LINEAR:
        assert f"lora_a_{hf}" in names, hf
    assert {"lora_b_q_proj", "lora_b_k_proj", "lora_b_v_proj", "lora_b_z_proj", "lora_b_out_proj"} <= names
    assert not jax.tree.leaves(nnx.state(model, LoRAMask))  # every layer selected: no masks
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var.get_value().ndim and "lora_rank" in axes, path
        assert var.get_value().dtype == jnp.float32
        assert (axes[0] == "layers") == (path[0] == "groups"), path


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
    [
        ({"rank": 0}, "rank"),
        ({"dropout": 1.0}, "dropout"),
        ({"targets": ("qkv",)}, "unknown LoRA targets"),
        ({"pattern": "layers.(1"}, "not a valid regex"),
        ({"layers": (-1, 2)}, "non-negative"),
        ({"layers": "1,x"}, "expected indices"),
        ({"layers": ()}, "empty"),
    ],
)
def test_invalid_lora_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs)


# ---- merge / unmerge ------------------------------------------------------------------------------
def test_merge_keeps_adapters_and_unmerge_restores_the_base(base, ids):
    # Layers 1 and 4: group position 1 is selected in group 0 only (a LoRAMask), plus the tail.
    lcfg = LoraConfig(rank=4, alpha=8.0, layers=(1, 4))
    model = base(SMALL)
    weights = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    add_lora(model, lcfg)
    randomize_b(model)
    adapted = FWD(model, ids)

    merge_lora(model, keep_adapters=True)
    assert jax.tree.leaves(nnx.state(model, LoRAParam))  # still there, switched off
    merged = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    changed = {p for p in weights if not np.array_equal(weights[p], merged[p])}
    assert changed and all("proj" in str(p[-1]) for p in changed)
    assert rel(FWD(model, ids), adapted) < 1e-5
    with pytest.raises(ValueError, match="already merged"):
        merge_lora(model)

    unmerge_lora(model)
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_allclose(np.asarray(v.get_value()), weights[p], rtol=0, atol=2e-7, err_msg=str(p))
    assert rel(FWD(model, ids), adapted) < 1e-6  # adapters live again
    with pytest.raises(ValueError, match="no merged adapters"):
        unmerge_lora(model)


# ---- gradients against peft --------------------------------------------------------------------
def test_adapter_gradients_match_peft(base, ids):
    """The next-token loss and the gradient of every lora_A / lora_B equal peft's on the same
    transformers model (fp32, random A and B): the adapter's own backward (`lora_delta`) is exact."""
    import peft
    import torch
    import torch.nn.functional as F
    from peft.utils import set_peft_model_state_dict
    from transformers import Qwen3_5ForCausalLM as HFModel

    from jaxpi.lora.peft import adapter_tensors
    from jaxpi.train.step import next_token_loss

    lcfg = LoraConfig(rank=4, alpha=8.0)
    model = add_lora(base(SMALL), lcfg)
    randomize_b(model, scale=0.2)
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    loss, grads = jax.jit(jax.value_and_grad(lambda lo: next_token_loss(nnx.merge(graphdef, lo, rest), ids)))(
        lora
    )
    weights = adapter_tensors(model, lcfg, "model.")
    nnx.update(model, grads)  # the gradients in peft's names and layout
    ours = adapter_tensors(model, lcfg, "model.")

    hf = HFModel.from_pretrained(base.dirs[SMALL], dtype=torch.float32)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(ALL_LINEAR))
    theirs_model = peft.get_peft_model(hf, pcfg)
    report = set_peft_model_state_dict(theirs_model, {k: torch.from_numpy(v) for k, v in weights.items()})
    assert not [k for k in report.unexpected_keys if "lora" in k]
    x = torch.from_numpy(np.array(ids)).long()
    logits = theirs_model(input_ids=x).logits
    t_loss = F.cross_entropy(logits[:, :-1].reshape(-1, SMALL.vocab_size), x[:, 1:].reshape(-1))
    t_loss.backward()
    theirs = {
        n.replace(".default", ""): p.grad.numpy()
        for n, p in theirs_model.named_parameters()
        if p.requires_grad
    }
    assert set(theirs) == set(ours)
    assert abs(float(loss) - t_loss.item()) <= 1e-5 * abs(t_loss.item())
    errs = {k: rel(jnp.asarray(ours[k]), jnp.asarray(theirs[k])) for k in ours}
    assert all(np.abs(v).max() > 0 for v in ours.values())
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-3, (worst, errs[worst])


# ---- dropout ----------------------------------------------------------------------------------------
def set_dropout(model, rate: float) -> None:
    """The same adapters at another dropout rate (the rate add_lora records on each module)."""
    for _, module in nnx.iter_graph(model):
        if hasattr(module, "lora_dropout"):
            module.lora_dropout = rate


def test_dropout_is_driven_by_the_key_and_gradients_flow(base, ids):
    # every kind of adapter (DeltaNet, attention, MLP) in two layers: five compiles of this model
    model = add_lora(base(PAIR), LoraConfig(rank=4, alpha=8.0, dropout=0.0))
    randomize_b(model)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    no_drop = FWD(model, ids)
    np.testing.assert_array_equal(FWD_KEY(model, ids, k1), no_drop)  # rate 0: the key changes nothing

    set_dropout(model, 0.3)
    np.testing.assert_array_equal(FWD(model, ids), no_drop)  # no key (evaluation, decoding): no dropout
    out1 = FWD_KEY(model, ids, k1)
    assert rel(out1, no_drop) > 1e-3
    np.testing.assert_array_equal(FWD_KEY(model, ids, k1), out1)  # same key, same masks
    assert rel(FWD_KEY(model, ids, k2), out1) > 1e-3

    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora, key):
        return jnp.mean(nnx.merge(graphdef, lora, rest)(ids, dropout_key=key) ** 2)

    grad = jax.jit(jax.grad(loss))
    g1, g2 = nnx.to_flat_state(grad(lora, k1)), nnx.to_flat_state(grad(lora, k2))
    assert len(g1) == len(nnx.to_flat_state(lora))
    for (path, a), (_, b) in zip(g1, g2, strict=True):
        a, b = a.get_value(), b.get_value()
        assert bool(jnp.all(jnp.isfinite(a))) and float(jnp.abs(a).max()) > 0, path
        assert float(jnp.abs(a - b).max()) > 0, path  # the mask reaches every adapter's gradient


def test_dropout_is_inverted_dropout_on_the_adapter_input(base):
    """With A and B picking input channel j into output channel j, the update s·(drop(x)·A)·B
    shows drop(x) itself: each element is 0 or x/(1-p), dropped about p of the time, and equal
    to the undropped update on average."""
    rate, rank = 0.25, 4
    model = add_lora(base(SMALL), LoraConfig(rank=rank, alpha=8.0, dropout=rate))
    mlp = model.tail[0].mlp
    mlp.lora_a_gate_proj.set_value(jnp.eye(SMALL.hidden_size, rank))  # [D, r]
    mlp.lora_b_gate_proj.set_value(jnp.eye(rank, SMALL.intermediate_size))  # [r, F]
    x = jax.random.normal(jax.random.key(0), (1, 3, SMALL.hidden_size))
    base_y = jnp.einsum("btd,df->btf", x, mlp.gate_proj[...])

    @jax.jit
    def dropped(keys):  # [K, B, T, r]: drop(x) on the first r channels
        delta = jax.vmap(lambda k: project(mlp, "gate_proj", x, "btd,df->btf", dropout_key=k) - base_y)(keys)
        return delta[..., :rank] / mlp.lora_scale, delta[..., rank:]

    got, rest = dropped(jax.random.split(jax.random.key(3), 2000))
    assert float(jnp.abs(rest).max()) < 1e-5  # nothing leaks outside the selected channels
    ratio = np.asarray(got / x[..., :rank])
    kept = np.isclose(ratio, 1.0 / (1.0 - rate), atol=1e-3)
    assert np.all(kept | np.isclose(ratio, 0.0, atol=1e-3))  # every element: dropped or rescaled
    assert abs(1.0 - kept.mean() - rate) < 0.02
    assert rel(got.mean(0), x[..., :rank]) < 0.05  # unbiased


# ---- selection -------------------------------------------------------------------------------------
def test_target_patterns_select_exactly_the_intended_modules():
    assert select_modules(CFG, LoraConfig(pattern=r"layers\.(1|3)\..*\.q_proj")) == [(3, "q_proj")]
    assert select_modules(CFG, LoraConfig(pattern=r"layers\.(1|3)\..*\.in_proj_qkv")) == [(1, "in_proj_qkv")]
    only = select_modules(CFG, LoraConfig(layers=range(2, 4), targets=("o_proj", "out_proj", "down_proj")))
    assert only == [(2, "out_proj"), (2, "down_proj"), (3, "o_proj"), (3, "down_proj")]
    assert LoraConfig(layers="0,4-6").layers == (0, 4, 5, 6)
    every = {(i, hf) for i, hf, _ in module_paths(CFG)}
    assert set(select_modules(CFG, LoraConfig())) == every and len(every) == 9 * 3 + 7 * 5 + 2 * 4
    with pytest.raises(ValueError, match="matches no module of this model"):
        select_modules(CFG, LoraConfig(pattern=r"model\.layers\.1\.self_attn\.q_proj"))
    with pytest.raises(ValueError, match=r"LoRA layers \[9, 12\] out of range"):
        select_modules(CFG, LoraConfig(layers=(1, 9, 12)))
    with pytest.raises(ValueError, match="LoRA selection matches no module"):
        select_modules(CFG, LoraConfig(targets=("q_proj",), layers=(0, 1)))  # DeltaNet layers


def test_gradients_reach_exactly_the_selected_adapters(base, ids):
    # Layers 0 and 3 in full, up_proj everywhere: DeltaNet layer 2 shares group position 0 with
    # layer 0 (a LoRAMask zeroes it), the tail layer 4 carries up_proj alone.
    lcfg = LoraConfig(rank=2, pattern=r"layers\.(0|3)\..*|layers\.[0-9]\.mlp\.up_proj")
    chosen = set(select_modules(SMALL, lcfg))
    assert {i for i, _ in chosen} == set(range(5)) and {hf for i, hf in chosen if i not in (0, 3)} == {
        "up_proj"
    }
    model = add_lora(base(SMALL), lcfg)
    randomize_b(model)  # B random in every stacked row, masked ones included
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        return jnp.mean(nnx.merge(graphdef, lora, rest)(ids) ** 2)

    grads = jax.jit(jax.grad(loss))(lora)
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(grads)}
    assert {n for n in names if n.startswith("lora_a_")} == {f"lora_a_{hf}" for _, hf in chosen}
    nnx.update(model, grads)  # read the gradients through the model's own layout
    for layer, hf, _ in module_paths(SMALL):
        module, row = adapter_module(model, layer, hf)
        g = getattr(module, f"lora_a_{hf}", None)
        if g is None:
            assert (layer, hf) not in chosen
            continue
        g = g.get_value() if row is None else g.get_value()[row]
        assert (float(jnp.abs(g).max()) > 0) == ((layer, hf) in chosen), (layer, hf)
    assert {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(model.tail[0], LoRAParam))} == {
        "lora_a_up_proj",
        "lora_b_up_proj",
    }
    masks = {str(p[-1]) for p, _ in nnx.to_flat_state(nnx.state(model, LoRAMask))}
    assert "lora_mask_in_proj_qkv" in masks and "lora_mask_up_proj" not in masks
