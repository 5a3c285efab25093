"""The Pallas fused-norm kernels (RMSNorm, gated RMSNorm) against the plain-JAX `jaxpi.kernels.norms`.

On this CPU the kernels run in Pallas' interpreters (the same kernel bodies the hardware compiles:
the GPU kernels in the generic interpreter, the TPU kernels in the TPU interpreter); the lowering
test checks that they also lower to Triton (GPU) and Mosaic (TPU) custom calls at the 27B's norm
shapes, without the hardware. The model test runs the tiny model with `model.norm_impl=pallas`.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import base64
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpi.config import QWEN3_5_27B
from jaxpi.kernels.norms import gated_rms_norm, inject_bug, rms_norm
from jaxpi.kernels.pallas import NormOptions, pallas_gated_rms_norm, pallas_rms_norm

jax.config.update("jax_enable_x64", False)

EPS = 1e-6
# 21 rows of 48 features: blocks of 8 rows leave a partial last block (5 rows), and 48 is not a
# power of two (the GPU tile pads it to 64); tile_rows 2 makes each GPU program loop 4 steps
SHAPE = (3, 7, 48)
BLOCKS = {"block_rows": 8, "tile_rows": 2}
# float32: the bar for the kernels. Measured: ≤ 1.1e-7 on every tensor (the kernels' sums run in
# another order than XLA's).
F32_TOL = 1e-6


def rel_err(a, b) -> float:
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_ulps(a, b) -> float:
    """Largest |a − b| in units of b's bfloat16 spacing (1 ulp: one rounding apart)."""
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    # bfloat16 keeps 8 significant bits: the spacing at |b| is 2^(floor(log2|b|) − 7)
    spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - 7)
    return float(np.max(np.abs(a - b) / spacing))


@functools.cache
def inputs(dtype: str) -> dict[str, jax.Array]:
    """x, gate z, zero-centred weight w (around 0), gated weight wg (around 1), cotangent dy."""
    rng = np.random.default_rng(0)
    d = SHAPE[-1]
    raw = {
        "x": 2.0 * rng.standard_normal(SHAPE) + 0.3,
        "z": 1.5 * rng.standard_normal(SHAPE),
        "w": 0.3 * rng.standard_normal(d),
        "wg": 1.0 + 0.3 * rng.standard_normal(d),
        "dy": rng.standard_normal(SHAPE),
    }
    return {k: jnp.asarray(v, dtype) for k, v in raw.items()}


def outputs_and_grads(rms, gated, a: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Both norms' outputs and their gradients for cotangent dy, traced now (so `inject_bug` applies)."""
    y, pullback = jax.vjp(lambda x, w: rms(x, w, EPS), a["x"], a["w"])
    dx, dw = pullback(a["dy"])
    yg, pullback = jax.vjp(lambda x, z, w: gated(x, z, w, EPS), a["x"], a["z"], a["wg"])
    dxg, dzg, dwg = pullback(a["dy"])
    return {"y": y, "dx": dx, "dw": dw, "gated y": yg, "gated dx": dxg, "gated dz": dzg, "gated dw": dwg}


@functools.cache
def plain(dtype: str) -> dict[str, jax.Array]:
    return outputs_and_grads(rms_norm, gated_rms_norm, inputs(dtype))


@pytest.mark.parametrize("interpret", [None, "tpu"], ids=["gpu-kernels", "tpu-kernels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_norms_match_plain_jax(dtype: str, interpret: str | None):
    """Forward and the gradients of x, w (and z) for both norms, partial last row block."""
    rms = functools.partial(pallas_rms_norm, interpret=interpret, **BLOCKS)
    gated = functools.partial(pallas_gated_rms_norm, interpret=interpret, **BLOCKS)
    got, want = outputs_and_grads(rms, gated, inputs(dtype)), plain(dtype)
    for what in want:
        assert got[what].dtype == want[what].dtype and got[what].shape == want[what].shape, what
        assert np.all(np.isfinite(np.asarray(got[what], np.float32))), what
        if dtype == "float32":
            err = rel_err(got[what], want[what])
            assert err <= F32_TOL, f"{what}: relative error {err:.2e} > {F32_TOL:.0e}"
        else:
            # both paths compute in float32 and round once to bfloat16: at most one rounding apart
            # (measured: equal but for one dw element in 48); a bf16 intermediate would be several
            assert bf16_ulps(got[what], want[what]) <= 1.0, what


def test_inject_bug_reaches_the_jax_path_only():
    """The parity harness's known-bad backward changes the plain path's dx; the kernels ignore it."""
    a = inputs("float32")
    rms = functools.partial(pallas_rms_norm, interpret=True)
    with inject_bug("rmsnorm-dx-no-offset"):
        buggy = outputs_and_grads(rms_norm, gated_rms_norm, a)
        kernels = outputs_and_grads(rms, gated_rms_norm, a)
    assert rel_err(buggy["dx"], plain("float32")["dx"]) > 1e-2
    assert rel_err(kernels["dx"], plain("float32")["dx"]) <= F32_TOL


def test_bad_arguments_are_refused():
    x, w, z = (inputs("float32")[k] for k in ("x", "w", "z"))
    with pytest.raises(ValueError, match=r"norm weight has shape \(47,\)"):
        pallas_rms_norm(x, w[:47])
    with pytest.raises(ValueError, match=r"gated norm gate has shape \(3, 7, 47\)"):
        pallas_gated_rms_norm(x, z[..., :47], w)
    with pytest.raises(ValueError, match="impl must be one of"):
        rms_norm(x, w, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        gated_rms_norm(x, z, w, impl="triton")
    with pytest.raises(ValueError, match="norm_impl"):
        QWEN3_5_27B.replace(norm_impl="triton")
    # Triton tiles are powers of two; Mosaic blocks are whole sublanes (8 rows)
    with pytest.raises(ValueError, match=r"block_rows \(24\) must be a power of two on GPU"):
        jax.eval_shape(functools.partial(pallas_rms_norm, block_rows=24, interpret=True), x, w)
    with pytest.raises(ValueError, match=r"block_rows \(12\) must be a multiple of 8 on TPU"):
        jax.eval_shape(functools.partial(pallas_rms_norm, block_rows=12, interpret="tpu"), x, w)
    with pytest.raises(ValueError, match="tile_rows must be a power of two"):
        NormOptions(tile_rows=3)
    with pytest.raises(ValueError, match="block_rows must be >= 1"):
        NormOptions(block_rows=0)
    with pytest.raises(ValueError, match="interpret must be None, True, False or 'tpu'"):
        NormOptions(interpret="gpu")


# What each platform's lowering must contain: the custom call, and the forward and backward kernel
# of both norms by name.
LOWERED = {
    "cuda": ("__gpu$xla.gpu.triton", r'name = "((?:gated_)?rms_norm_(?:forward|backward))"'),
    "tpu": ("tpu_custom_call", r'kernel_name = "((?:gated_)?rms_norm_(?:forward|backward))"'),
}


@pytest.mark.parametrize("platform", sorted(LOWERED))
def test_lowers_for_gpu_and_tpu_at_27b_shapes(platform: str):
    """Forward + backward exported for the platform from this CPU, bf16, at the 27B's three norm
    shapes: hidden 5120 (block norms), 256 (per-head q/k norms), 128 (the DeltaNet gated norm).

    This checks the Pallas → Triton / Mosaic lowering (tile shapes, masks, the ops the kernels
    use, the per-platform dispatch), not the device compiler after it (registers, VMEM limits).
    """
    cfg, b, t = QWEN3_5_27B, 1, 256
    spec = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    vh, vd = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes = [spec((b, t, cfg.hidden_size)), spec((cfg.hidden_size,))]
    shapes += [spec((b, t, cfg.num_attention_heads, cfg.head_dim)), spec((cfg.head_dim,))]
    shapes += [spec((b, t, vh, vd)), spec((b, t, vh, vd)), spec((vd,))]

    def step(h, wh, q, wq, o, z, wg):
        def loss(*xs):
            parts = (
                pallas_rms_norm(xs[0], xs[1]),
                pallas_rms_norm(xs[2], xs[3]),
                pallas_gated_rms_norm(xs[4], xs[5], xs[6]),
            )
            return sum(jnp.sum(p.astype(jnp.float32)) for p in parts)

        return jax.value_and_grad(loss, argnums=tuple(range(7)))(h, wh, q, wq, o, z, wg)

    # Triton calls carry no serialisation-compatibility promise; the check is only for stored exports
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=unchecked)(
        *shapes
    ).mlir_module()
    target, kernel_name = LOWERED[platform]
    assert re.findall(r"custom_call @([\w$.]+)", text).count(target) == 6
    names = sorted(m.group(1) for m in re.finditer(kernel_name, text))
    assert names == sorted(
        ["rms_norm_forward"] * 2
        + ["rms_norm_backward"] * 2
        + ["gated_rms_norm_forward", "gated_rms_norm_backward"]
    )
    if platform == "cuda":
        # 256 rows at hidden 5120: one row per program (halved from 64 to fill the GPU); 6144 q rows
        # and 12288 gated rows: 16 and 32 rows per program
        grids = re.findall(r"grid_x = (\d+) : i32, grid_y = 1 : i32, grid_z = 1 : i32", text)
        assert sorted(map(int, grids)) == [256, 256, 384, 384, 384, 384]
    else:  # every Mosaic kernel's row blocks are independent ("parallel": megacore may split them)
        bodies = [base64.b64decode(b) for b in re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", text)]
        assert len(bodies) == 6
        assert all(b"parallel" in body and b"arbitrary" not in body for body in bodies)


def test_model_config_selects_the_pallas_norms_end_to_end(tmp_path):
    """`model.norm_impl=pallas` reaches every norm of the model (block norms, q/k norms, the DeltaNet
    gated norm, the final norm): the same loss and gradients as the plain path."""
    from flax import nnx

    from jaxpi import TINY, load_hf
    from jaxpi.config import FULL, LINEAR
    from jaxpi.hf_fixtures import make_checkpoint
    from jaxpi.train.base import ModelConfig

    with pytest.raises(ValueError, match="norm_impl"):
        ModelConfig(norm_impl="triton")
    cfg = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))  # one of each mixer
    ckpt = make_checkpoint(tmp_path / "ckpt", cfg, seed=5)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 13)), jnp.int32)
    results = {}
    for impl in ("jax", "pallas"):
        model = load_hf(ckpt, config_overrides=ModelConfig(norm_impl=impl).overrides())[1]
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, p)(ids) ** 2)

        # 2 block norms per layer, q and k norms, the gated norm and the final norm: 8 kernels, each
        # traced once per platform branch (cuda, rocm, tpu, cpu)
        jaxpr = str(jax.make_jaxpr(loss)(params))
        assert jaxpr.count("pallas_call") == (8 * 4 if impl == "pallas" else 0)
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        results[impl] = (float(value), jax.tree.leaves(grads))
    # measured: the same loss to the last bit, gradients ≤ 4.0e-7 apart (relative, per parameter)
    assert abs(results["pallas"][0] - results["jax"][0]) <= 1e-6 * abs(results["jax"][0])
    for got, want in zip(results["pallas"][1], results["jax"][1], strict=True):
        assert rel_err(got, want) <= 2e-6
