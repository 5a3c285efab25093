"""The Pallas chunk-recurrence kernels against the plain-JAX chunked gated delta rule and float64.

On this CPU the kernels run in Pallas' interpreters (the same kernel bodies the GPU/TPU compile:
the GPU kernels in the generic interpreter, the TPU kernels in the TPU interpreter); the lowering
test checks that they also lower to Triton (GPU) and Mosaic (TPU) custom calls at the 27B's head
shapes, without the hardware.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import base64
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpi.bench.config import make_config
from jaxpi.bench.gdn import gdn_bench
from jaxpi.kernels.gated_delta import chunk_gated_delta_rule
from jaxpi.kernels.pallas import KernelOptions, pallas_chunk_gated_delta_rule

jax.config.update("jax_enable_x64", False)

ARG_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# Pallas vs plain JAX, both float32: the bars tests/test_gated_delta.py holds the plain-JAX kernel
# to against transformers. Measured here: ≤ 1.9e-7 on every tensor.
FWD_TOL = 1e-5
GRAD_TOL = 1e-4
# The sharper bar is a float64 recurrence: both float32 kernels sit 1e-7–2.3e-7 from it (measured;
# the Pallas kernel's error was 0.75–1.36× the plain-JAX kernel's, tensor by tensor), so the kernel may
# be at most 2× further off than the plain-JAX path: it must not lose precision.
F64_FACTOR = 2.0
F64_FLOOR = 1e-8

CASES = {  # batch, length, key heads, value heads, Dk, Dv, chunk, block_v, segments, initial state
    # GQA, T not a multiple of the chunk, two packed segments per row, two Dv blocks, a carried state
    "gqa_segments_state": (2, 37, 2, 4, 32, 32, 16, 16, True, True),
    # one head pair, T a multiple of the chunk, no segments, zero initial state, one Dv block
    "plain": (1, 64, 1, 1, 16, 16, 16, None, False, False),
}
# (case, interpret, split): the GPU kernels in the generic interpreter (the CPU default), and the
# TPU kernels (one chunk per grid step, the state in VMEM scratch) in the TPU interpreter; the
# fused chunk scan and the split one (`gated_delta.split_chunk_scan` with the recurrence kernel).
# "plain" runs only in `make test-slow`: the GQA case covers every kernel path it does.
RUNS = [
    ("gqa_segments_state", None, False),
    ("gqa_segments_state", "tpu", False),
    ("gqa_segments_state", None, True),
    ("gqa_segments_state", "tpu", True),
    pytest.param("plain", None, False, marks=pytest.mark.slow),
]


def make_case(name: str) -> tuple[tuple[np.ndarray, ...], np.ndarray | None, dict]:
    b, t, hk, hv, dk, dv, chunk, block_v, segments, with_state = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    # Qwen3.5's gates: g = −exp(A_log)·softplus(a), β = sigmoid(b); exp(A_log) from 0.01 to 0.3 so
    # a chunk's decay e^{Σg} stays between ~0.9 and ~0.03: the state carried across chunks matters
    g = -np.geomspace(0.01, 0.3, hv) * np.logaddexp(0, normal(b, t, hv))
    beta = 1 / (1 + np.exp(-normal(b, t, hv)))
    args = (normal(b, t, hk, dk), normal(b, t, hk, dk), normal(b, t, hv, dv), g.astype(np.float32))
    args += (
        beta.astype(np.float32),
        normal(b, hv, dk, dv) if with_state else np.zeros((b, hv, dk, dv), np.float32),
    )
    segment_ids = None
    if segments:  # a reset mid-chunk in row 0, one on a chunk boundary in row 1
        segment_ids = np.stack([np.repeat([4, 1], [10, t - 10]), np.repeat([0, 7], [chunk, t - chunk])])
    return args, segment_ids, {"chunk_size": chunk, "block_v": block_v}


def cotangents(args: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(99)
    return rng.standard_normal(args[2].shape).astype(np.float32), rng.standard_normal(args[5].shape).astype(
        np.float32
    )


def outputs_and_grads(fn, args, segment_ids, cot_out, cot_state):
    """(out, state, grads of Σ out·cot_out + Σ state·cot_state w.r.t. ARG_NAMES), one jitted call."""

    def loss(*xs):
        out, state = fn(*xs[:5], initial_state=xs[5], segment_ids=segment_ids)
        return jnp.sum(out * cot_out) + jnp.sum(state * cot_state), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return out, state, grads


def float64_recurrence(args, segment_ids, cot_out, cot_state):
    """The recurrence of gated_delta's docstring token by token in torch float64, with its gradients."""
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in args]
    q, k, v, g, beta, state = leaves
    # the kernel's L2 norm (ε inside the root), the Dk^-½ scale, key heads repeated to value heads
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    outs = []
    for t in range(v.shape[1]):
        if segment_ids is not None and t > 0:
            keep = torch.tensor(segment_ids[:, t] == segment_ids[:, t - 1], dtype=torch.float64)
            state = state * keep[:, None, None, None]
        state = state * torch.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outs, dim=1)
    ((out * torch.from_numpy(cot_out)).sum() + (state * torch.from_numpy(cot_state)).sum()).backward()
    return out.detach().numpy(), state.detach().numpy(), [x.grad.numpy() for x in leaves]


def rel_err(a, b) -> float:
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def named(res) -> dict[str, np.ndarray]:
    out, state, grads = res
    return {
        "output": out,
        "final state": state,
        **{f"d{n}": x for n, x in zip(ARG_NAMES, grads, strict=True)},
    }


@functools.cache
def references(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The plain-JAX path's and the float64 recurrence's results for a case (shared by its runs)."""
    args, segment_ids, kw = make_case(name)
    plain = functools.partial(chunk_gated_delta_rule, chunk_size=kw["chunk_size"])
    ref = outputs_and_grads(plain, args, segment_ids, *cotangents(args))
    return named(ref), named(float64_recurrence(args, segment_ids, *cotangents(args)))


@pytest.mark.parametrize(
    ("name", "interpret", "split"),
    RUNS,
    ids=["gqa-gpu", "gqa-tpu", "gqa-gpu-split", "gqa-tpu-split", "plain-gpu"],
)
def test_pallas_matches_plain_jax_and_float64(name: str, interpret: str | None, split: bool):
    args, segment_ids, kw = make_case(name)
    pallas = functools.partial(pallas_chunk_gated_delta_rule, interpret=interpret, split=split, **kw)
    got = named(outputs_and_grads(pallas, args, segment_ids, *cotangents(args)))
    ref, f64 = references(name)
    assert got["output"].shape == args[2].shape and got["final state"].shape == args[5].shape
    for what in got:
        assert np.all(np.isfinite(got[what])), what
        tol = FWD_TOL if what in ("output", "final state") else GRAD_TOL
        err = rel_err(got[what], ref[what])
        assert err <= tol, f"{what}: pallas vs plain JAX relative error {err:.2e} > {tol:.0e}"
        err_pallas, err_plain = rel_err(got[what], f64[what]), rel_err(ref[what], f64[what])
        assert err_pallas <= F64_FACTOR * err_plain + F64_FLOOR, (
            f"{what}: vs float64, pallas {err_pallas:.2e} against plain JAX {err_plain:.2e}"
        )


def test_bench_gdn_pallas_times_both_paths():
    """`gdn_bench(impl="pallas")` goes through `chunk_gated_delta_rule(impl="pallas")` (forward alone,
    which keeps no boundary states, and forward + backward) and times the plain-JAX path beside it."""
    bench = make_config("tiny", seq=40, repeats=1, warmup=1)  # 40: a partial last chunk of 16
    res = gdn_bench(bench, vs_torch=False, impl="pallas")
    assert res["impl"] == "pallas" and res["interpreted"] is True
    for side in ("jaxpi", "plain_jax"):
        for fig in ("fwd_s", "fwd_bwd_s", "fwd_flop_per_s", "fwd_bwd_flop_per_s"):
            assert res[side][fig]["median"] > 0 and math.isfinite(res[side][fig]["median"]), (side, fig)
    for part in ("fwd", "fwd_bwd"):
        expected = res["plain_jax"][f"{part}_s"]["median"] / res["jaxpi"][f"{part}_s"]["median"]
        assert res[f"speedup_pallas_{part}"] == pytest.approx(expected)
    # same inputs, both fp32, outputs of order 1: the two paths compute the same thing
    assert res["max_abs_diff_pallas_vs_plain"] < 1e-5
    with pytest.raises(ValueError, match="impl must be one of"):
        gdn_bench(bench, vs_torch=False, impl="triton")


def test_bad_arguments_are_refused():
    args = make_case("gqa_segments_state")[0]
    # checked while tracing: eval_shape runs nothing
    with pytest.raises(ValueError, match="impl must be one of"):
        jax.eval_shape(functools.partial(chunk_gated_delta_rule, impl="triton"), *args[:5])
    with pytest.raises(ValueError, match=r"block_v \(24\) must divide the value head dim \(32\)"):
        jax.eval_shape(functools.partial(pallas_chunk_gated_delta_rule, chunk_size=16, block_v=24), *args[:5])
    with pytest.raises(ValueError, match="block_v must be >= 1"):
        KernelOptions(block_v=0)
    with pytest.raises(ValueError, match="precision must be one of"):
        KernelOptions(precision="bf16")
    with pytest.raises(ValueError, match="interpret must be None, True, False or 'tpu'"):
        KernelOptions(interpret="gpu")


# What each platform's lowering must contain: the custom call and the kernels by name.
LOWERED = {
    "cuda": ("__gpu$xla.gpu.triton", r'name = "(\w+)_kernel"'),
    "tpu": ("tpu_custom_call", r'kernel_name = "(\w+)_kernel"'),
}


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("platform", sorted(LOWERED))
def test_lowers_for_gpu_and_tpu_at_27b_head_shapes(platform: str, split: bool):
    """Forward + backward exported for the platform from this CPU: Dk = Dv = 128, chunk 64, bf16 q/k/v.
    Fused: the forward and backward kernels; split: the recurrence kernel once per direction.

    This checks the Pallas → Triton / Mosaic lowering (block shapes, the ops the kernels use, the
    per-platform dispatch), not the device compiler after it (register and shared-memory limits).
    """
    b, t, hk, hv, d = 1, 256, 2, 4, 128
    spec = jax.ShapeDtypeStruct
    shapes = [spec((b, t, hk, d), jnp.bfloat16)] * 2 + [spec((b, t, hv, d), jnp.bfloat16)]
    shapes += [spec((b, t, hv), jnp.float32)] * 2 + [
        spec((b, hv, d, d), jnp.float32),
        spec((b, t), jnp.int32),
    ]

    def lowered(precision: str) -> str:
        def step(*xs):
            def loss(*ys):
                out, state = pallas_chunk_gated_delta_rule(
                    *ys[:5], initial_state=ys[5], segment_ids=xs[6], precision=precision, split=split
                )
                return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state)

            return jax.value_and_grad(loss, argnums=tuple(range(6)))(*xs[:6])

        # Triton calls carry no serialisation-compatibility promise; the check is only for stored exports
        unchecked = [jax.export.DisabledSafetyCheck.custom_call(target)]
        return jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=unchecked)(
            *shapes
        ).mlir_module()

    target, kernel_name = LOWERED[platform]
    text = lowered("default")
    assert re.findall(r"custom_call @([\w$.]+)", text).count(target) == 2
    names = ["recurrence", "recurrence"] if split else ["backward", "forward"]
    assert sorted(m.group(1) for m in re.finditer(kernel_name, text)) == names
    if platform == "cuda":
        # grid (batch, value heads, Dv / block_v) with block_v 32
        assert text.count("grid_x = 1 : i32, grid_y = 4 : i32, grid_z = 4 : i32") == 2

        # the precision reaches the Triton dots (IEEE fp32 vs TF32 lowers to a different kernel);
        # "default" follows JAX's default matmul precision, as the plain path's dots do
        # (the Triton calls compared: the plain-JAX preparation follows the setting too)
        def kernels(text: str) -> list[str]:
            return [line[line.index("custom_call") :] for line in text.splitlines() if target in line]

        highest = kernels(lowered("highest"))
        assert highest != kernels(text) and kernels(lowered("tf32")) == kernels(text)
        with jax.default_matmul_precision("highest"):
            assert kernels(lowered("default")) == highest
    else:  # the Mosaic kernels (MLIR bytecode, base64) step through the chunks with a VMEM scratch
        bodies = [base64.b64decode(b) for b in re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", text)]
        assert len(bodies) == 2
        for body in bodies:
            assert b"arbitrary" in body and b"scratch_operands" in body


def test_model_config_selects_the_pallas_path_end_to_end(tmp_path):
    """`model.gdn_impl=pallas` / `pallas_split` (and `model.gdn_kernel`) reach every DeltaNet layer:
    the logits and gradients of jax."""
    from flax import nnx

    from jaxpi import TINY, load_hf
    from jaxpi.hf_fixtures import make_checkpoint
    from jaxpi.train.base import ModelConfig

    with pytest.raises(ValueError, match="gdn_impl"):
        ModelConfig(gdn_impl="triton")
    ckpt = make_checkpoint(tmp_path / "ckpt", TINY.replace(num_hidden_layers=2), seed=3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 21)), jnp.int32)
    seg = jnp.asarray([[0] * 9 + [1] * 12])
    results = {}
    with pytest.raises(ValueError, match="gdn_kernel"):
        ModelConfig(gdn_impl="jax", gdn_kernel="block_v=8")
    # the split path with its kernel settings from the config: two Dv blocks of 8 per head
    kernel = {"jax": "", "pallas": "", "pallas_split": "block_v=8"}
    for impl in ("jax", "pallas", "pallas_split"):
        overrides = ModelConfig(gdn_impl=impl, gdn_kernel=kernel[impl]).overrides()
        model = load_hf(ckpt, config_overrides=overrides)[1]
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, p)(ids, segment_ids=seg) ** 2)

        # the kernels are in the traced program exactly when they were asked for, as configured
        jaxpr = str(jax.make_jaxpr(loss)(params))
        assert ("pallas_call" in jaxpr) == impl.startswith("pallas")
        if impl != "jax":
            # grids (batch, heads, Dv blocks) for GPU, (batch, heads, chunks) for the TPU branch
            heads, dv = TINY.linear_num_value_heads, TINY.linear_value_head_dim
            gpu = f"1, {heads}, {dv // (8 if impl == 'pallas_split' else min(dv, 32))}"
            assert set(re.findall(r"grid=\(([^)]*)\)", jaxpr)) == {gpu, f"1, {heads}, 1"}
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        results[impl] = (float(value), jax.tree.leaves(grads))
    for impl in ("pallas", "pallas_split"):
        assert abs(results[impl][0] - results["jax"][0]) <= 1e-6 * abs(results["jax"][0]), impl
        for got, want in zip(results[impl][1], results["jax"][1], strict=True):
            assert rel_err(got, want) <= 1e-5, impl
