"""The fused RMSNorm kernels (hand-written `custom_vjp` backward) against transformers' torch modules
`Qwen3_5RMSNorm` / `Qwen3_5RMSNormGated` and our autodiff references (fp32, CPU), plus the
known-bad backward passes that `inject_bug` swaps in.

Measured (CPU, fp32, 4 seeds): forward ≤ 1.1e-7, backward (dx, dw, dz) ≤ 1.5e-7 relative L2 against torch
and against autodiff. Injected bugs change their gradients by 0.07 (double-weight dx) to ~1.1.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from jaxpi.kernels.norms import (
    KNOWN_BUGS,
    gated_rms_norm,
    gated_rms_norm_reference,
    inject_bug,
    rms_norm,
    rms_norm_reference,
)

jax.config.update("jax_enable_x64", False)

FWD_TOL = 1e-6
GRAD_TOL = 1e-5
EPS = 1e-6
SHAPE = (3, 7, 48)  # [..., D]: several leading axes so dw sums over all rows


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = (np.asarray(t.detach() if isinstance(t, torch.Tensor) else t, np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_inputs(seed: int, shape=SHAPE) -> dict[str, np.ndarray]:
    """x, gate z, zero-centred weight w (random around 0), gated weight wg (around 1), cotangent dy."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    d = shape[-1]
    return {
        "x": 2.0 * normal(*shape) + 0.3,
        "z": 1.5 * normal(*shape),
        "w": 0.3 * normal(d),
        "wg": (1.0 + 0.3 * normal(d)).astype(np.float32),
        "dy": normal(*shape),
    }


def rms_vjp(fn, x, w, dy):
    """Output and (dx, dw) of `fn(x, w)` for cotangent dy (traced now, so `inject_bug` applies)."""
    y, pullback = jax.vjp(lambda x, w: fn(x, w, EPS), jnp.asarray(x), jnp.asarray(w))
    return y, pullback(jnp.asarray(dy, y.dtype))


def gated_vjp(fn, x, z, w, dy):
    """Output and (dx, dz, dw) of `fn(x, z, w)` for cotangent dy."""
    y, pullback = jax.vjp(lambda x, z, w: fn(x, z, w, EPS), jnp.asarray(x), jnp.asarray(z), jnp.asarray(w))
    return y, pullback(jnp.asarray(dy, y.dtype))


def torch_rms(x, w, dy):
    mod = Qwen3_5RMSNorm(x.shape[-1], eps=EPS)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(w))
    xt = torch.tensor(x, requires_grad=True)
    y = mod(xt)
    (y * torch.from_numpy(dy)).sum().backward()
    return y.detach().numpy(), (xt.grad.numpy(), mod.weight.grad.numpy())


def torch_gated(x, z, w, dy):
    mod = Qwen3_5RMSNormGated(x.shape[-1], eps=EPS)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(w))
    xt, zt = torch.tensor(x, requires_grad=True), torch.tensor(z, requires_grad=True)
    y = mod(xt, zt)
    (y * torch.from_numpy(dy)).sum().backward()
    return y.detach().numpy(), (xt.grad.numpy(), zt.grad.numpy(), mod.weight.grad.numpy())


# ---- correctness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm_matches_hf_and_reference(seed: int):
    a = make_inputs(seed)
    y, (dx, dw) = rms_vjp(rms_norm, a["x"], a["w"], a["dy"])
    y_t, (dx_t, dw_t) = torch_rms(a["x"], a["w"], a["dy"])
    y_r, (dx_r, dw_r) = rms_vjp(rms_norm_reference, a["x"], a["w"], a["dy"])

    assert y.dtype == jnp.float32
    assert rel_err(y, y_t) <= FWD_TOL
    assert rel_err(y, y_r) <= FWD_TOL
    for name, ours, hf, ref in (("dx", dx, dx_t, dx_r), ("dw", dw, dw_t, dw_r)):
        assert rel_err(ours, hf) <= GRAD_TOL, name
        assert rel_err(ours, ref) <= GRAD_TOL, name


@pytest.mark.parametrize("seed", [0, 1])
def test_gated_rms_norm_matches_hf_and_reference(seed: int):
    a = make_inputs(seed)
    y, grads = gated_vjp(gated_rms_norm, a["x"], a["z"], a["wg"], a["dy"])
    y_t, grads_t = torch_gated(a["x"], a["z"], a["wg"], a["dy"])
    y_r, grads_r = gated_vjp(gated_rms_norm_reference, a["x"], a["z"], a["wg"], a["dy"])

    assert y.dtype == jnp.float32
    assert rel_err(y, y_t) <= FWD_TOL
    assert rel_err(y, y_r) <= FWD_TOL
    for name, ours, hf, ref in zip(("dx", "dz", "dw"), grads, grads_t, grads_r, strict=True):
        assert rel_err(ours, hf) <= GRAD_TOL, name
        assert rel_err(ours, ref) <= GRAD_TOL, name


def test_norms_under_jit_match_eager():
    """The custom_vjp is the same function when jitted (the model always is)."""
    a = make_inputs(2)

    @jax.jit
    def grads(x, z, w, wg, dy):
        _, (dx, dw) = rms_vjp(rms_norm, x, w, dy)
        _, (gx, gz, gw) = gated_vjp(gated_rms_norm, x, z, wg, dy)
        return dx, dw, gx, gz, gw

    jitted = grads(a["x"], a["z"], a["w"], a["wg"], a["dy"])
    eager = (
        *rms_vjp(rms_norm, a["x"], a["w"], a["dy"])[1],
        *gated_vjp(gated_rms_norm, a["x"], a["z"], a["wg"], a["dy"])[1],
    )
    for j, e in zip(jitted, eager, strict=True):
        assert rel_err(j, e) <= 1e-6


def test_bf16_inputs():
    """bf16 in → bf16 out (computed in fp32 inside), close to the fp32 result; grads keep dtypes."""
    a = make_inputs(3)
    xb, zb, dyb = (jnp.asarray(a[k], jnp.bfloat16) for k in ("x", "z", "dy"))
    wb, wgb = jnp.asarray(a["w"], jnp.bfloat16), jnp.asarray(a["wg"], jnp.bfloat16)
    # fp32 results on the bf16-rounded inputs isolate the output rounding
    x32, z32, w32, wg32, dy32 = (np.asarray(t, np.float32) for t in (xb, zb, wb, wgb, dyb))

    y, (dx, dw) = rms_vjp(rms_norm, xb, wb, dyb)
    y32, (dx32, dw32) = rms_vjp(rms_norm, x32, w32, dy32)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert rel_err(y, y32) <= 8e-3  # one bf16 rounding: ≤ 2^-9 per element
    assert rel_err(dx, dx32) <= 8e-3
    assert rel_err(dw, dw32) <= 8e-3
    y_t, _ = torch_rms(x32, w32, dy32)
    assert rel_err(y, y_t) <= 8e-3

    y, (gx, gz, gw) = gated_vjp(gated_rms_norm, xb, zb, wgb, dyb)
    y32, (gx32, gz32, gw32) = gated_vjp(gated_rms_norm, x32, z32, wg32, dy32)
    assert y.dtype == gx.dtype == gz.dtype == gw.dtype == jnp.bfloat16
    # HF's gated norm rounds x̂ to the input dtype before the weight; ours rounds once at the end
    assert rel_err(y, y32) <= 8e-3
    for ours, ref in ((gx, gx32), (gz, gz32), (gw, gw32)):
        assert rel_err(ours, ref) <= 8e-3
    mod = Qwen3_5RMSNormGated(SHAPE[-1], eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(wg32))
    y_t = mod(torch.from_numpy(x32).bfloat16(), torch.from_numpy(z32).bfloat16())
    assert y_t.dtype == torch.bfloat16
    assert rel_err(np.asarray(y, np.float32), y_t.float()) <= 1.6e-2  # two bf16 roundings in HF


# ---- injected bugs ---------------------------------------------------------------------------------

# bug -> (norm, gradients it must change, gradients it must leave alone)
BUG_EFFECTS = {
    "rmsnorm-dx-no-offset": ("rms", {"dx"}, {"dw"}),
    "rmsnorm-dx-double-weight": ("rms", {"dx"}, {"dw"}),
    "gated-norm-pre-gate": ("gated", {"dx", "dw"}, {"dz"}),
}


def test_bug_table_covers_known_bugs():
    assert set(BUG_EFFECTS) == set(KNOWN_BUGS)


def _norm_outputs(kind: str, a: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    if kind == "rms":
        y, (dx, dw) = rms_vjp(rms_norm, a["x"], a["w"], a["dy"])
        return y, {"dx": dx, "dw": dw}
    y, (dx, dz, dw) = gated_vjp(gated_rms_norm, a["x"], a["z"], a["wg"], a["dy"])
    return y, {"dx": dx, "dz": dz, "dw": dw}


@pytest.mark.parametrize("bug", sorted(BUG_EFFECTS))
def test_injected_bug_keeps_forward_and_breaks_gradient(bug: str):
    kind, affected, unaffected = BUG_EFFECTS[bug]
    a = make_inputs(4)
    y_clean, g_clean = _norm_outputs(kind, a)
    with inject_bug(bug):
        y_bug, g_bug = _norm_outputs(kind, a)
        # the other norm is untouched by this bug
        other = "gated" if kind == "rms" else "rms"
        y_other, g_other = _norm_outputs(other, a)
    y_other_clean, g_other_clean = _norm_outputs(other, a)

    np.testing.assert_array_equal(np.asarray(y_bug), np.asarray(y_clean))
    for name in affected:
        assert rel_err(g_bug[name], g_clean[name]) > 1e-2, name
    for name in unaffected:
        np.testing.assert_array_equal(np.asarray(g_bug[name]), np.asarray(g_clean[name]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(y_other), np.asarray(y_other_clean))
    for name in g_other:
        np.testing.assert_array_equal(
            np.asarray(g_other[name]), np.asarray(g_other_clean[name]), err_msg=name
        )

    # the context restores the clean kernels on exit
    _, g_after = _norm_outputs(kind, a)
    for name in g_clean:
        np.testing.assert_array_equal(np.asarray(g_after[name]), np.asarray(g_clean[name]), err_msg=name)


def test_bug_is_read_at_trace_time():
    """A function jitted (traced) outside the context keeps the clean kernel."""
    a = make_inputs(5)
    grad_dx = jax.jit(lambda x, w, dy: rms_vjp(rms_norm, x, w, dy)[1][0])
    clean = grad_dx(a["x"], a["w"], a["dy"])
    with inject_bug("rmsnorm-dx-no-offset"):
        np.testing.assert_array_equal(np.asarray(grad_dx(a["x"], a["w"], a["dy"])), np.asarray(clean))


def test_inject_none_is_clean_and_unknown_bug_raises():
    a = make_inputs(6)
    _, clean = _norm_outputs("rms", a)
    with inject_bug(None):
        _, same = _norm_outputs("rms", a)
    for name in clean:
        np.testing.assert_array_equal(np.asarray(same[name]), np.asarray(clean[name]))
    with pytest.raises(ValueError, match="unknown bug"), inject_bug("rmsnorm-no-such-bug"):
        pass
