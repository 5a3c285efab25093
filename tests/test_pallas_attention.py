"""Flash attention (JAX's Pallas GPU and TPU kernels) against the plain blocked causal attention.

On this CPU the GPU kernel runs in Pallas' interpreter and the TPU kernel in the TPU interpreter
(the kernel bodies the devices compile); the lowering test exports both from this CPU (Triton and
Mosaic custom calls at the 27B's attention shapes).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxpi.kernels.attention import causal_attention
from jaxpi.kernels.pallas.attention import AttentionOptions, pallas_causal_attention

# float32 both: measured ≤ 3.2e-7 (GPU kernel) and ≤ 2.7e-7 (TPU kernel) on every tensor (the
# online softmax sums in another order)
TOL = 1e-5
SMALL = {
    "gpu": AttentionOptions(block_q=16, block_k=16, block_backward=16),
    "tpu": AttentionOptions(interpret="tpu"),
}


def rel_err(a, b) -> float:
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def case(seed: int, b: int = 2, t: int = 37, hkv: int = 2, g: int = 3, d: int = 32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, hkv * g, d))
    k, v = (jax.random.normal(x, (b, t, hkv, d)) for x in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], q.shape)


def outputs_and_grads(fn, q, k, v, cot):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cot))


@pytest.mark.parametrize(
    ("kernel", "packed"),
    [("gpu", True), ("gpu", False), ("tpu", True)],
    ids=["gpu-segments", "gpu-one", "tpu-segments"],
)
def test_flash_attention_matches_the_blocked_core(kernel: str, packed: bool):
    """GQA 3:1, T = 37 (padded to the kernel's blocks inside), packed segments or none: the output
    and the q, k, v gradients of `causal_attention`."""
    q, k, v, cot = case(0)
    seg = jnp.asarray(np.repeat([[0, 1, 2], [5, 5, 6]], [11, 17, 9], axis=1), jnp.int32) if packed else None
    want = jax.jit(lambda *a: outputs_and_grads(lambda q, k, v: causal_attention(q, k, v, segments=seg), *a))(
        q, k, v, cot
    )
    flash = functools.partial(pallas_causal_attention, segments=seg, options=SMALL[kernel])
    # the TPU kernel on CPU: its interpreter for the forward and the backward (module docstring)
    with pltpu.force_tpu_interpret_mode() if kernel == "tpu" else contextlib.nullcontext():
        got = jax.jit(lambda *a: outputs_and_grads(flash, *a))(q, k, v, cot)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape and np.all(np.isfinite(a)), name
        assert rel_err(a, b) <= TOL, f"{name}: {rel_err(a, b):.2e}"
    if packed and kernel == "gpu":  # the segments matter: without them the second segment's outputs move
        alone = pallas_causal_attention(q, k, v, options=SMALL[kernel])
        assert rel_err(alone[:, 11:], got[0][:, 11:]) > 1e-2


def test_bad_options_and_heads_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        AttentionOptions(block_q=48)
    q, k, v, _ = case(1, hkv=2, g=1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pallas_causal_attention(q, jnp.concatenate([k, k[:, :, :1]], axis=2), v)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowering_at_27b_attention_shapes(platform: str):
    """Forward + backward exported from this CPU at the 27B's attention heads (24 query, 4 kv,
    head_dim 256, bf16): a Triton call (GPU) or a Mosaic call (TPU) for each of the kernel's
    forward and backward passes."""
    spec = jax.ShapeDtypeStruct
    shapes = [spec((1, 256, 24, 256), jnp.bfloat16)] + [spec((1, 256, 4, 256), jnp.bfloat16)] * 2
    shapes.append(spec((1, 256), jnp.int32))

    def step(q, k, v, seg):
        loss = lambda q, k, v: jnp.sum(pallas_causal_attention(q, k, v, segments=seg).astype(jnp.float32))  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(target)]
    text = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=unchecked)(
        *shapes
    ).mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text).count(target)
    # GPU: the forward, the backward's preprocessing and its dK/dV + dQ kernel; TPU: the forward,
    # the dK/dV and the dQ kernels
    assert calls == 3
    if platform == "cuda":
        assert "mha_forward" in text and "mha_backward" in text
    else:
        names = set(re.findall(r'kernel_name = "(\w+)"', text))
        assert names == {
            "_flash_attention_kernel",
            "_flash_attention_dkv_kernel",
            "_flash_attention_dq_kernel",
        }


def test_model_config_selects_flash_attention_end_to_end(tmp_path):
    """`model.attn_impl=pallas` (with `model.attn_kernel`'s blocks) reaches the attention layers:
    the loss and gradients of `jax`."""
    from flax import nnx

    from jaxpi import TINY, load_hf
    from jaxpi.config import FULL, LINEAR
    from jaxpi.hf_fixtures import make_checkpoint
    from jaxpi.train.base import ModelConfig

    with pytest.raises(ValueError, match="attn_impl"):
        ModelConfig(attn_impl="cudnn")
    with pytest.raises(ValueError, match=r"model\.attn_kernel .* applies only to attn_impl pallas"):
        ModelConfig(attn_kernel="block_q=16")
    cfg = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    ckpt = make_checkpoint(tmp_path / "ckpt", cfg, seed=4)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 21)), jnp.int32)
    seg = jnp.asarray([[0] * 9 + [1] * 12])
    results = {}
    for impl in ("jax", "pallas"):
        kernel = "block_q=16,block_k=16,block_backward=16" if impl == "pallas" else ""
        model = load_hf(ckpt, config_overrides=ModelConfig(attn_impl=impl, attn_kernel=kernel).overrides())[1]
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, p)(ids, segment_ids=seg) ** 2)

        jaxpr = str(jax.make_jaxpr(loss)(params))
        assert ("pallas_call" in jaxpr) == (impl == "pallas")
        if impl == "pallas":  # the forward's grid (query blocks, batch, heads): 21 tokens in 2 blocks of 16
            assert f"grid=(2, 1, {cfg.num_attention_heads})" in jaxpr
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        results[impl] = (float(value), jax.tree.leaves(grads))
    assert abs(results["pallas"][0] - results["jax"][0]) <= 1e-6 * abs(results["jax"][0])
    for got, want in zip(results["pallas"][1], results["jax"][1], strict=True):
        assert rel_err(got, want) <= 1e-5
