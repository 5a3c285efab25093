"""The Pallas kernels under a mesh: each kernel call runs in `jax.shard_map` (jaxpi/kernels/pallas/sharded.py).

On 8 virtual CPU devices (tests/conftest.py) the kernels run in Pallas' interpreter. Checked: the
sharded LoRA gradient step with `gdn_impl`, `norm_impl` and `attn_impl` = pallas gives the loss and adapter
gradients of the plain-JAX kernels under the same strategy; every `pallas_call` in its program sits
inside a shard_map with the batch and head axes split and the sequence whole, and the lowered
StableHLO holds the manual computations; a strategy that splits the sequence, with fewer key heads
than head shards, still gives the plain-JAX results (the sequence gathered for the recurrence, q/k
repeated to the value heads); and exported for GPU / TPU from this CPU under the mesh, the Triton /
Mosaic custom calls sit inside the manual regions.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpi import TINY, Qwen3_5ForCausalLM
from jaxpi.config import FULL, LINEAR
from jaxpi.hf_fixtures import seeded_noise
from jaxpi.kernels.gated_delta import chunk_gated_delta_rule
from jaxpi.kernels.norms import gated_rms_norm
from jaxpi.kernels.pallas import pallas_chunk_gated_delta_rule, pallas_gated_rms_norm, pallas_rms_norm
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.params import activation_sharding
from jaxpi.train.step import loss_and_grads
from sharding.mesh import make_mesh
from sharding.strategies import (
    Strategy,
    activation_resolver,
    batch_sharding,
    get_strategy,
    param_shardings,
    with_activation_constraints,
)

needs_8 = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 (virtual) devices, see tests/conftest.py"
)

# One DeltaNet and one attention layer: every kernel the model calls (the gated delta rule, the
# block norms, the per-head q/k norms, the gated output norm, flash attention) in the smallest program.
CFG = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))
B, T = 4, 24  # T: one whole chunk of 16 and a padded one
# The bars tests/test_pallas_gdn.py holds the model on the Pallas path to (fp32): the loss (here
# also the kernels' outputs) 1e-6 relative, every gradient 1e-5 relative (norm of the difference
# over the norm).
FWD_RTOL, GRAD_RTOL = 1e-6, 1e-5
# LLVM at -O0: XLA's CPU compile of these programs takes half the time; both sides compile alike.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def rel_err(got, want) -> float:
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def walk(jaxpr: jex.core.Jaxpr, inside: bool = False):
    """(equation, inside a shard_map?) for every equation, sub-programs included."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jex.core.Jaxpr):
                    yield from walk(sub, inside or eqn.primitive.name == "shard_map")


def kernel_placement(fn, *args, traced=None) -> tuple[int, int, list]:
    """(pallas_calls inside a shard_map, pallas_calls outside, the shard_maps' equations) of
    `fn(*args)`'s program, or of an already `traced` jit."""
    eqns = list(walk((traced or jax.jit(fn).trace(*args)).jaxpr.jaxpr))
    calls = [inside for eqn, inside in eqns if eqn.primitive.name == "pallas_call"]
    return sum(calls), len(calls) - sum(calls), [eqn for eqn, _ in eqns if eqn.primitive.name == "shard_map"]


# ---- the sharded LoRA step ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_model():
    """Graph definitions for both kernel paths, one random state (LoRA B non-zero) and a packed batch."""

    def split(impl: str):
        cfg = CFG.replace(gdn_impl=impl, norm_impl=impl, attn_impl=impl)
        build = lambda: add_lora(Qwen3_5ForCausalLM(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4))  # noqa: E731
        return nnx.split(nnx.eval_shape(build))

    (plain, abstract), (pallas, _) = split("jax"), split("pallas")
    rng = np.random.default_rng(0)
    cut = rng.integers(6, T - 6, B)
    batch = {
        "input_ids": rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
        "loss_mask": np.ones((B, T), np.int32),
        "segment_ids": (np.arange(T)[None, :] >= cut[:, None]).astype(np.int32),
    }
    return {"jax": plain, "pallas": pallas}, seeded_noise(abstract), batch


CASES = [
    ("fsdp_tp", "fsdp=4,tensor=2", "fsdp", "tensor"),  # batch and heads split
    # batch only, the tensor axis unused: the kernels whole over it (`make test-slow`, ~20 s more)
    pytest.param("dp", "data=4,tensor=2", "data", None, marks=pytest.mark.slow),
]


@needs_8
@pytest.mark.parametrize(("name", "spec", "batch_axis", "head_axis"), CASES, ids=["fsdp_tp", "dp"])
def test_sharded_lora_step_on_the_pallas_path_equals_plain_jax(lora_model, name, spec, batch_axis, head_axis):
    graphdefs, state, batch = lora_model
    strategy, mesh = get_strategy(name), make_mesh(spec)
    shardings = param_shardings(state, strategy, mesh)
    params = jax.device_put(state, shardings)
    in_shardings = (shardings, batch_sharding(strategy, mesh, (B, T)))
    results = {}
    for impl, graphdef in graphdefs.items():
        # the train step's loss and gradient function, jitted as jit_train_step does
        fn = with_activation_constraints(loss_and_grads(graphdef, trainable=LoRAParam), strategy, mesh)
        traced = jax.jit(fn, in_shardings=in_shardings).trace(params, batch)
        inside, outside, maps = kernel_placement(fn, traced=traced)
        lowered = traced.lower()
        manual = lowered.as_text().count("sdy.manual_computation")
        if impl == "jax":
            assert inside == outside == len(maps) == manual == 0
        else:
            # every kernel call (forward and backward, each platform's branch) runs per shard
            assert inside > 0 and outside == 0, (inside, outside)
            assert manual == len(maps) > 0
            specs = {s for eqn in maps for s in eqn.params["in_specs"]}
            assert P(batch_axis, None, head_axis, None) in specs  # q, k, v [B, T, H, D]; o, z too
            assert P(batch_axis, None, head_axis) in specs  # g, beta [B, T, Hv]
            assert P(batch_axis, None, None) in specs  # the residual stream's norms [B, T, D]
            # the sequence whole in every [B, T, ...] operand
            operands = [
                (x.aval.shape, s) for e in maps for x, s in zip(e.invars, e.params["in_specs"], strict=True)
            ]
            assert all(len(s) < 2 or s[1] is None for shape, s in operands if shape[1:2] == (T,))
        loss, grads = lowered.compile(FAST_COMPILE)(params, batch)
        results[impl] = float(loss), jax.tree.leaves(grads)
    (loss, grads), (want_loss, want_grads) = results["pallas"], results["jax"]
    assert abs(loss - want_loss) <= FWD_RTOL * abs(want_loss), (loss, want_loss)
    assert len(grads) == len(want_grads) == len(jax.tree.leaves(nnx.state(state, LoRAParam)))
    for got, want in zip(grads, want_grads, strict=True):
        assert np.linalg.norm(np.asarray(want)) > 0
        assert rel_err(got, want) <= GRAD_RTOL


# ---- a split sequence, uneven GQA ------------------------------------------------------------------
# The sequence over fsdp (sequence parallel), heads over tensor; the DeltaNet has one key head for
# two value heads, so its key heads cannot split over tensor=2.
SEQ_SPLIT = Strategy(
    "seq_split_test",
    activations={
        "batch": "data",
        "seq": "fsdp",
        **{h: "tensor" for h in ("q_heads", "kv_heads", "gdn_v_heads")},
    },
)


def gdn_inputs(b=2, t=24, hk=1, hv=2, dk=16, dv=16, seed=0) -> tuple[np.ndarray, ...]:
    """q, k, v, g, beta, initial state, gate z, norm weight; segment ids (a reset mid-chunk)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    g = (-np.geomspace(0.01, 0.3, hv) * np.logaddexp(0, normal(b, t, hv))).astype(np.float32)
    beta = (1 / (1 + np.exp(-normal(b, t, hv)))).astype(np.float32)
    arrays = (normal(b, t, hk, dk), normal(b, t, hk, dk), normal(b, t, hv, dv), g, beta)
    arrays += (normal(b, hv, dk, dv), normal(b, t, hv, dv), 1 + 0.2 * normal(dv))
    segments = np.tile(np.repeat([0, 1], [t // 2 - 2, t // 2 + 2]), (b, 1)).astype(np.int32)
    return arrays, segments


def gdn_then_norm(impl: str, segments, *xs):
    """(a weighted Σ of the gated norm of the rule's output and of its final state, (both))."""
    q, k, v, g, beta, s0, z, w = xs
    if impl == "pallas":
        o, state = pallas_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=16, initial_state=s0, segment_ids=segments
        )
        y = pallas_gated_rms_norm(o, z, w)
    else:
        o, state = chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=16, initial_state=s0, segment_ids=segments
        )
        y = gated_rms_norm(o, z, w)
    weights = jnp.linspace(-1.0, 1.0, y.size).reshape(y.shape)
    return jnp.sum(y * weights) + jnp.sum(jnp.sin(state)), (y, state)


@needs_8
def test_split_sequence_is_gathered_and_uneven_key_heads_repeated():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    arrays, segments = gdn_inputs()
    resolve = activation_resolver(SEQ_SPLIT, mesh)
    axes = [("batch", "seq", "gdn_k_heads", "head_dim")] * 2 + [("batch", "seq", "gdn_v_heads", "head_dim")]
    axes += [("batch", "seq", "gdn_v_heads")] * 2 + [("batch", "gdn_v_heads", None, None)]
    axes += [("batch", "seq", "gdn_v_heads", "head_dim"), (None,)]
    placed = [jax.device_put(x, resolve(a, x.shape)) for x, a in zip(arrays, axes, strict=True)]
    assert placed[2].sharding.spec == P("data", "fsdp", "tensor", None)  # the sequence arrives split
    forward = functools.partial(gdn_then_norm, "pallas", segments)
    grad = functools.partial(jax.value_and_grad, argnums=tuple(range(8)), has_aux=True)
    sharded = with_activation_constraints(grad(forward), SEQ_SPLIT, mesh)
    inside, outside, _ = kernel_placement(sharded, *placed)
    assert inside > 0 and outside == 0

    rule, norm = kernel_placement(with_activation_constraints(forward, SEQ_SPLIT, mesh), *placed)[2]
    specs = rule.params["in_specs"]
    # q/k repeated to the 2 value heads, then split like v; the sequence whole for the recurrence
    tokens = [
        x.aval.shape for x, s in zip(rule.invars, specs, strict=True) if s == P("data", None, "tensor", None)
    ]
    assert tokens == [(2, 24, 2, 16)] * 3
    assert P("data", None, "tensor") in specs and P("data", "tensor", None, None) in specs
    assert specs[-1] == P("data", None)  # segment ids
    assert all(s[1] is None for x, s in zip(rule.invars, specs, strict=True) if x.aval.shape[1:2] == (24,))
    # the norm keeps the sequence split: its rows are independent
    assert norm.params["in_specs"] == (P("data", "fsdp", "tensor", None),) * 2 + (P(),)

    (_, outputs), grads = jax.jit(sharded).lower(*placed).compile(FAST_COMPILE)(*placed)
    plain = jax.jit(grad(functools.partial(gdn_then_norm, "jax", segments))).lower(*arrays)
    (_, want_outputs), want_grads = plain.compile(FAST_COMPILE)(*arrays)
    # the outputs, not the scalar: its sum cancels (±1 weights), so its rounding says nothing
    for name, got, want in zip(("norm output", "final state"), outputs, want_outputs, strict=True):
        assert rel_err(got, want) <= FWD_RTOL, name
    for name, got, want in zip(
        ("q", "k", "v", "g", "beta", "state", "z", "w"), grads, want_grads, strict=True
    ):
        assert rel_err(got, want) <= GRAD_RTOL, name


def test_without_a_mesh_nothing_changes():
    """No resolver, or a resolver on a one-device mesh: the kernels run as before, no shard_map."""
    (q, k, v, g, beta, s0, z, w), segments = gdn_inputs(b=1, t=8)
    fn = lambda *xs: gdn_then_norm("pallas", segments[:1], *xs)  # noqa: E731
    inside, outside, maps = kernel_placement(fn, q, k, v, g, beta, s0, z, w)
    assert outside > 0 and inside == 0 and not maps
    with activation_sharding(
        activation_resolver(get_strategy("fsdp_tp"), make_mesh("fsdp=1", devices=jax.devices()[:1]))
    ):
        assert kernel_placement(fn, q, k, v, g, beta, s0, z, w)[1:] == (outside, [])


@needs_8
def test_norm_axes_are_explicit_or_by_rank():
    mesh = make_mesh("fsdp=4,tensor=2")
    x, w = jnp.ones((4, 8, 2, 16)), jnp.ones(16)
    with activation_sharding(activation_resolver(get_strategy("fsdp_tp"), mesh)):
        for axes, want in [
            (None, P("fsdp", None, "tensor", None)),  # [B, T, H, D]: the head axes agree on tensor
            (("batch", "seq", None, "head_dim"), P("fsdp", None, None, None)),
            ((None, None, "kv_heads", None), P(None, None, "tensor", None)),
        ]:
            maps = kernel_placement(functools.partial(pallas_rms_norm, axes=axes), x, w)[2]
            assert maps[0].params["in_specs"] == (want, P()), axes
        with pytest.raises(ValueError, match=r"norm input of shape \(4, 8, 2, 16\) annotated with 3 axes"):
            jax.eval_shape(functools.partial(pallas_rms_norm, axes=("batch", "seq", None)), x, w)
        clash = "norm input: logical axes 'q_heads' and 'kv_heads' are both split over mesh axis 'tensor'"
        with pytest.raises(ValueError, match=clash):
            jax.eval_shape(functools.partial(pallas_rms_norm, axes=(None, "q_heads", "kv_heads", None)), x, w)


# ---- lowered for the accelerators under the mesh ----------------------------------------------------
TARGETS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def manual_regions(text: str) -> tuple[list[str], list[str]]:
    """(the sdy.manual_computation lines, every custom call line outside their regions). A region is
    the lines after its op indented deeper than it (MLIR's printer indents nested regions)."""
    heads, outside, depth = [], [], None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if depth is not None and indent <= depth and line.strip():
            depth = None  # the region's closing brace
        if "sdy.manual_computation" in line and depth is None:
            heads.append(line)
            depth = indent
        elif "custom_call @" in line and depth is None:
            outside.append(line)
    return heads, outside


@needs_8
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_exported_kernels_sit_in_manual_regions(platform: str, split: bool):
    """Forward + backward of the rule and the gated norm, exported for the platform under fsdp_tp on
    fsdp=4,tensor=2 at the 27B's DeltaNet head shapes (Dk = Dv = 128, chunk 64, bf16 inputs); the
    rule's fused chunk-scan kernels, or the split scan's recurrence kernel (once per direction)."""
    mesh, strategy = make_mesh("fsdp=4,tensor=2"), get_strategy("fsdp_tp")
    b, t, hk, hv, d = 4, 128, 2, 4, 128
    spec = jax.ShapeDtypeStruct
    shapes = [spec((b, t, hk, d), jnp.bfloat16)] * 2 + [spec((b, t, hv, d), jnp.bfloat16)]
    shapes += [spec((b, t, hv), jnp.float32)] * 2 + [
        spec((b, t, hv, d), jnp.bfloat16),
        spec((d,), jnp.float32),
    ]

    def loss(q, k, v, g, beta, z, w):
        o, state = pallas_chunk_gated_delta_rule(q, k, v, g, beta, split=split)
        return jnp.sum(pallas_gated_rms_norm(o, z, w).astype(jnp.float32)) + jnp.sum(state)

    step = with_activation_constraints(jax.value_and_grad(loss, argnums=tuple(range(7))), strategy, mesh)
    # the inputs arrive as the model's constraints leave them: batch and heads split
    resolve = activation_resolver(strategy, mesh)
    axes = [("batch", "seq", "gdn_k_heads", "head_dim")] * 2 + [("batch", "seq", "gdn_v_heads", "head_dim")]
    axes += [("batch", "seq", "gdn_v_heads")] * 2 + [("batch", "seq", "gdn_v_heads", "head_dim"), (None,)]
    placed = [resolve(a, x.shape) for a, x in zip(axes, shapes, strict=True)]
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(TARGETS[platform])]
    jitted = jax.jit(step, in_shardings=placed)
    exported = jax.export.export(jitted, platforms=[platform], disabled_checks=unchecked)(*shapes)
    text = exported.mlir_module()
    assert exported.nr_devices == 8
    # four kernels: the rule's forward and backward, the norm's forward and backward
    assert re.findall(r"custom_call @([\w$.]+)", text).count(TARGETS[platform]) == 4
    heads, outside = manual_regions(text)
    assert not [line for line in outside if TARGETS[platform] in line]
    assert len(heads) == 4 and all('manual_axes={"fsdp", "tensor"}' in h for h in heads)
    # the rule's q, k, v enter split over batch (fsdp) and heads (tensor), the sequence whole
    ins = heads[0].split("out_shardings")[0]
    assert ins.count('<@mesh, [{"fsdp"}, {}, {"tensor"}, {}]>') == 3
