"""QLoRA in the model: a quantized frozen base read by `project`, sharded like the weights it
replaces, differentiated only through the adapters, trained by `jaxpi sft`; and its refusals.

The checkpoint is the tiny Qwen3.5 with DeltaNet value heads of 32, so that every linear layer's
input is a multiple of the 64-weight block, as in every released Qwen3.5 (the plain tiny config's
out_proj has 96 inputs, stored with flat scales: `tests/test_quant.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from transformers import AutoModelForCausalLM

from jaxpi.config import QWEN3_5_27B, TINY
from jaxpi.convert.hf import load_hf
from jaxpi.convert.quantize import abstract_model, dequantized, quantized_bytes
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.quantized import QuantizedWeight, QuantParam
from jaxpi.train.checkpoint import load_adapter
from jaxpi.train.export import export
from jaxpi.train.metrics import read_jsonl
from jaxpi.train.step import loss_and_grads, next_token_loss
from sharding.mesh import abstract_mesh
from sharding.strategies import get_strategy, param_shardings

ROOT = Path(__file__).resolve().parents[1]
QLORA_TINY = TINY.replace(linear_value_head_dim=32)
# two periods of (DeltaNet, attention): the layers run as a scan over 2 stacked groups
SCANNED = QLORA_TINY.replace(num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from jaxpi.hf_fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qlora") / "base", QLORA_TINY, seed=0, tokenizer=True)


@pytest.fixture(scope="module")
def scanned(tmp_path_factory) -> Path:
    from jaxpi.hf_fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qlora") / "scanned", SCANNED, seed=1)


def _with_adapters(model, seed: int = 1):
    """Adapters on every linear layer, B random too (so every factor gets a gradient)."""
    add_lora(model, LoraConfig(rank=4, alpha=8.0), key=jax.random.key(seed))
    state = nnx.state(model, LoRAParam)
    rng = np.random.default_rng(seed)
    filled = jax.tree.map(lambda v: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32), state)
    nnx.update(model, filled)
    return model


def _batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (2, 24)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 14], 2, axis=0), jnp.int32)
    return {"input_ids": ids, "segment_ids": seg}


@pytest.mark.parametrize("kind", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_quantized_base_computes_its_dequantized_weights(scanned, kind):
    """The quantized model's loss and LoRA gradients are those of a dense model holding the
    dequantized weights: the dequantize-on-the-fly matmul changes nothing but the storage. The
    layers run as a scan over stacked groups, the quantized arrays sliced per group."""
    _, q = load_hf(scanned, "float32", base_quant=kind)
    assert q.groups is not None and isinstance(q.groups.blocks[1].mixer.q_proj, QuantizedWeight)
    assert q.groups.blocks[1].mixer.q_proj.codes.get_value().shape[0] == 2  # stacked over 2 groups
    _, d = load_hf(scanned, "float32", base_quant=kind)
    dequantized(d)
    assert not [m for _, m in nnx.iter_graph(d) if isinstance(m, QuantizedWeight)]
    _with_adapters(q), _with_adapters(d)
    batch = _batch()
    results = []
    for model in (q, d):
        graphdef, params = nnx.split(model)
        loss, grads = jax.jit(loss_and_grads(graphdef, trainable=LoRAParam))(params, batch)
        results.append((float(loss), nnx.to_flat_state(grads)))
    (lq, gq), (ld, gd) = results
    assert abs(lq - ld) <= 1e-6 * abs(ld)
    assert [p for p, _ in gq] == [p for p, _ in gd] and len(gq) > 0
    for (path, a), (_, b) in zip(gq, gd, strict=True):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), path
    # and the quantization is real: the dequantized weights are not the checkpoint's
    _, f = load_hf(scanned, "float32")
    w_hat, w = d.groups.blocks[0].mlp.down_proj[...], f.groups.blocks[0].mlp.down_proj[...]
    lo, hi = {"nf4": (0.05, 0.15), "int8": (0.002, 0.02)}[kind]  # a 4-bit and an 8-bit grid
    assert lo < float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w)) < hi


def test_only_adapters_are_trained_and_no_weight_is_kept(base):
    """The stored arrays are `QuantParam`s (0.52 byte per quantized weight for nf4), outside the
    trainable state; the backward keeps none of the dequantized weights, even without remat
    (without the custom VJP, every layer's rebuilt weight would be a residual)."""
    _, model = load_hf(base, "float32", base_quant="nf4")
    stored, params = quantized_bytes(model)
    assert 0.515 < stored / params < 0.52, stored / params
    _with_adapters(model)
    graphdef, state = nnx.split(model)
    train, rest = nnx.split_state(state, LoRAParam, ...)
    assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(train))
    assert any(isinstance(v, QuantParam) for _, v in nnx.to_flat_state(rest))
    batch = _batch()

    def loss(train):
        return next_token_loss(nnx.merge(graphdef, train, rest), **batch)

    residuals = saved_residuals(loss, train)
    dense = {tuple(m.layout.shape) for _, m in nnx.iter_graph(model) if isinstance(m, QuantizedWeight)}
    kept = [(aval.shape, why) for aval, why in residuals if jnp.issubdtype(aval.dtype, jnp.floating)]
    assert not [k for k in kept if tuple(k[0]) in dense], kept


def test_quantized_arrays_are_sharded_like_their_weights():
    """On the 27B (abstract: nothing allocated), each quantized projection's codes get the spec
    its dense weight gets, the block scales split on the same axes where divisible, and the
    per-tensor arrays stay whole."""
    mesh = abstract_mesh("fsdp=8,tensor=4")
    strategy = get_strategy("fsdp_tp")
    dense = nnx.state(abstract_model(QWEN3_5_27B, jnp.bfloat16))
    quant = nnx.state(abstract_model(QWEN3_5_27B, jnp.bfloat16, "nf4"))
    ds = {tuple(p): v.get_value().spec for p, v in nnx.to_flat_state(param_shardings(dense, strategy, mesh))}
    qs = {tuple(p): v.get_value().spec for p, v in nnx.to_flat_state(param_shardings(quant, strategy, mesh))}
    checked = 0
    for path, spec in qs.items():
        if path[-1] == "codes":
            assert spec == ds[path[:-1]], path
            checked += 1
        elif path[-1] in ("scale", "offset"):
            assert all(e is None for e in spec), path
    assert checked == 37  # one scanned group: 3 DeltaNet layers × (7 parts + 3 MLP) + attention (4 + 3)
    q_proj = ("groups", "blocks", 3, "mixer", "q_proj")
    assert ds[q_proj] == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert qs[(*q_proj, "absmax")] == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec,strategy", [("fsdp=4", "fsdp"), ("fsdp=2,tensor=2", "fsdp_tp")])
def test_sharded_qlora_step_is_one_devices(base, mesh_spec, strategy):
    """The quantized base loaded onto a mesh (codes and scales on their weights' shardings) gives the
    one-device loss and LoRA gradients to float32 rounding; the step gathers the codes and
    dequantizes after (`QuantizedWeight.gathered`). Measured: loss equal, LoRA gradients at most
    2.7e-5 relative (median 8.9e-6), where a dense base gives 1.6e-5 (8.2e-6)."""
    from sharding.mesh import make_mesh
    from sharding.strategies import loader_shardings, with_activation_constraints

    mesh = make_mesh(mesh_spec, devices=jax.devices()[:4])
    strat = get_strategy(strategy)
    loader = loader_shardings(nnx.state(abstract_model(QLORA_TINY, jnp.float32, "nf4")), strat, mesh)
    batch = {k: np.asarray(v) for k, v in _batch().items()}
    results = []
    for shardings in (None, loader):
        _, model = load_hf(base, "float32", base_quant="nf4", shardings=shardings)
        _with_adapters(model)
        graphdef, params = nnx.split(model)
        fn = loss_and_grads(graphdef, trainable=LoRAParam)
        if shardings is not None:
            fn = with_activation_constraints(fn, strat, mesh)
            spec = model.tail[0].mlp.gate_proj.codes.get_value().sharding.spec
            assert (
                spec
                == param_shardings(nnx.state(model), strat, mesh)["tail"][0]["mlp"]["gate_proj"]["codes"]
                .get_value()
                .spec
            )
        loss, grads = jax.jit(fn)(params, batch)
        results.append((float(loss), [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(grads)]))
    (l1, g1), (l2, g2) = results
    assert abs(l1 - l2) <= 1e-6 * abs(l1)
    errors = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(g1, g2, strict=True)]
    assert max(errors) < 1e-4 and np.median(errors) < 2e-5, (max(errors), np.median(errors))


def test_refusals(tmp_path):
    """Bad inputs are errors that name the field (and, for a shape nf4 cannot store, the tensor)."""
    from jaxpi.plan.request import PlanRequest
    from jaxpi.rl.config import GRPOConfig

    with pytest.raises(ValueError, match=r"lora\.base_quant must be one of none, nf4, int8, got 'fp4'"):
        LoraConfig(base_quant="fp4")
    with pytest.raises(ValueError, match=r"base_quant 'nf4' needs LoRA \(lora_rank\)"):
        PlanRequest(model="tiny", mesh="fsdp=1", base_quant="nf4")  # full fine-tuning
    with pytest.raises(ValueError, match=r"lora\.base_quant='nf4': jaxpi grpo trains on the dense base"):
        GRPOConfig(lora=LoraConfig(base_quant="nf4"))
    from jaxpi.hf_fixtures import make_checkpoint

    odd = make_checkpoint(tmp_path / "odd", TINY.replace(linear_value_head_dim=15), seed=0)
    with pytest.raises(ValueError, match=r"out_proj\.weight: nf4 packs .* \(15\) must be even"):
        load_hf(odd, "float32", base_quant="nf4")


@pytest.fixture(scope="module")
def run(base, tmp_path_factory) -> Path:
    """`jaxpi sft lora.base_quant=nf4` on the tiny base: 10 steps of synthetic 64-token rows."""
    out = tmp_path_factory.mktemp("qlora-run") / "run"
    cmd = [
        sys.executable, "-m", "jaxpi.cli", "sft", "--config", str(ROOT / "configs/sft/tiny.yaml"), "--json",
        f"model.base={base}", f"output.dir={out}", "lora.base_quant=nf4", "output.loggers=[]",
        "data.source=synthetic", "data.seq_len=64", "data.batch_size=4", "data.synthetic_examples=48",
        "train.steps=10", "train.checkpoint_every=10", "train.eval_every=5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_qlora_sft_trains(run):
    """The loss falls; the run records the base format (the export reads it)."""
    records = read_jsonl(run / "metrics.jsonl")
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-3:]])
    assert last < first - 0.3, (first, last)
    assert json.loads((run / "config.json").read_text())["lora"]["base_quant"] == "nf4"
    _, lcfg, meta = load_adapter(run)
    assert lcfg.base_quant == "nf4" and meta["dtype"] == "float32"
    # the step trained on the quantized base: its stored arrays, as a quantized load holds them
    _, model = load_hf(meta["base"], "float32", base_quant="nf4")
    assert meta["quantized_base_bytes"] == quantized_bytes(model)[0] > 0


def _jaxpi_logits(base: Path, run: Path, ids: np.ndarray) -> np.ndarray:
    """The trained QLoRA model's logits in jaxpi: the nf4 base and the run's adapter."""
    adapter, lcfg, _ = load_adapter(run)
    _, model = load_hf(base, "float32", base_quant=lcfg.base_quant)
    add_lora(model, lcfg)
    nnx.update(model, adapter)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    return np.asarray(forward(state, jnp.asarray(ids)), np.float64)


@pytest.mark.slow
def test_peft_adapter_reloads_on_the_bitsandbytes_base(base, run, tmp_path):
    """The exported adapter, loaded by peft on the base quantized by bitsandbytes (CPU), gives
    jaxpi's logits (the two hold the same codes; measured max |Δ| ~1e-5, float32 rounding)."""
    from jaxpi.torch_reference import load_quantized, with_adapter

    summary = export(run, tmp_path / "peft")
    assert summary["base_quant"] == "nf4" and summary["format"] == "peft"
    ids = np.random.default_rng(1).integers(0, 512, (2, 20))
    want = _jaxpi_logits(base, run, ids)
    # train mode (no dropout: the same function): in eval mode bitsandbytes 0.50.2 repacks the
    # weights for its AVX512-BF16 CPU kernel, which asserts on out_features not a multiple of 32
    # (in_proj_a/b: 6 here, 48 in the 27B)
    peft = with_adapter(load_quantized(base, "nf4", "float32"), tmp_path / "peft")
    with torch.no_grad():
        got = peft(input_ids=torch.tensor(ids), use_cache=False).logits.double().numpy()
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


@pytest.mark.slow
def test_merged_export_is_the_dequantized_base_plus_adapter(base, run, tmp_path):
    """`--merged` merges into the dequantized nf4 base (what the adapter was trained against) and
    writes BF16; transformers reloads it with jaxpi's QLoRA logits: float32 merged to float32
    rounding (3e-6), bf16 to bf16 rounding of the weights (8e-2 on this random-weight model).
    Merging into the original float base instead is off by the quantization error (0.69)."""
    ids = np.random.default_rng(2).integers(0, 512, (2, 20))
    want = _jaxpi_logits(base, run, ids)
    results = {}
    for dtype, quant in ((None, None), ("float32", None), ("float32", "none")):
        out = tmp_path / f"merged-{dtype}-{quant}"
        export(run, out, fmt="merged", dtype=dtype, base_quant=quant)
        config = json.loads((out / "config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            got = model(input_ids=torch.tensor(ids), use_cache=False).logits.double().numpy()
        results[(dtype, quant)] = (config.get("dtype"), np.linalg.norm(got - want) / np.linalg.norm(want))
    bf16, f32, dense = results[(None, None)], results[("float32", None)], results[("float32", "none")]
    assert bf16[0] == "bfloat16" and f32[0] == "float32", results
    assert f32[1] < 2e-5, results
    assert bf16[1] < 0.15 and bf16[1] < dense[1] / 4, results


def test_plan_of_a_qlora_step():
    """`jaxpi plan --base-quant nf4` on the 27B (analytic, seconds): the parameters per device are
    the nf4 base (0.516 byte per quantized weight), the bf16 embedding and LM head and the float32
    adapters; a third of the bf16 plan's."""
    from jaxpi.testing.xla import child_env

    argv = [sys.executable, "-m", "jaxpi.cli", "plan", "--model", "qwen3_5_27b", "--mesh", "fsdp=1"]
    argv += ["--lora-rank", "64", "--no-compile", "--json"]
    plans = {}
    for quant in ("none", "nf4"):
        proc = subprocess.run([*argv, "--base-quant", quant], capture_output=True, text=True, env=child_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        plans[quant] = json.loads(proc.stdout)["analytic"]
    gib = 1024**3
    assert (
        abs(plans["nf4"]["params"] / gib - 18.18) < 0.01 and abs(plans["none"]["params"] / gib - 51.84) < 0.01
    )
    assert plans["nf4"]["trainable"] == plans["none"]["trainable"]


@pytest.mark.slow
def test_compiled_plan_of_a_sharded_qlora_step():
    """The quantized step compiles sharded (fsdp over 4 devices): argument bytes compiled equal the
    analytic ones, which hold the quantized arrays as sharded; and it gathers the codes, not the
    dequantized weights: 465 KB per step against the analytic 856 KB (gathering the rebuilt
    float32 weights instead, without `QuantizedWeight.gathered`, moved 2.47 MB)."""
    from jaxpi.testing.xla import child_env

    argv = [
        sys.executable,
        "-m",
        "jaxpi.cli",
        "plan",
        "--model",
        "tiny",
        "--mesh",
        "fsdp=4",
        "--seq-len",
        "32",
    ]
    argv += ["--lora-rank", "4", "--base-quant", "nf4", "--dtype", "float32", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["compiled"]["argument"] == r["analytic"]["argument"] and r["compiled"]["temp"] > 0
    assert r["collectives"]["all-gather"]["bytes"] <= r["collectives_analytic"]["all-gather"]["bytes"]
