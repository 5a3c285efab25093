"""The parity harness catches backward bugs that keep the loss: for each of `KNOWN_BUGS` (the fused
norms', and the Gated DeltaNet classes public kernels shipped: the short conv's weight gradient
for short chunks, the decay gate's gradient from the pre-exp sum, the q/k L2 norm without its
1/‖x‖, a segment reset one token late), `run_parity(..., inject=bug)` reproduces transformers'
loss exactly, yet fails, and names the parameters whose gradients the bug corrupts (and only
those).

One TINY checkpoint (layers 0-2 Gated DeltaNet, layer 3 attention) and one clean run are shared.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import jax
import jax.numpy as jnp
import pytest

from jaxpi.config import TINY
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.kernels.inject import KNOWN_BUGS, inject_bug
from jaxpi.parity import run_parity

SEQ_LEN, BATCH, SEED = 48, 2, 0
BIG = 1e-3  # a corrupted gradient is off by far more than float32 noise (~1e-6)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("inject") / "tiny", TINY, seed=7)


@pytest.fixture(scope="module")
def clean(hf_dir):
    return run_parity(hf_dir, seq_len=SEQ_LEN, batch=BATCH, seed=SEED)


@pytest.fixture(scope="module")
def clean_packed(hf_dir):
    return run_parity(hf_dir, seq_len=SEQ_LEN, batch=BATCH, seed=SEED, segments=3)


def layer(i: int, rest: str) -> str:
    return f"model.layers.{i}.{rest}"


# The zero-centred RMSNorm dX is wrong in every norm, the final one included, so every gradient
# upstream of the final norm is corrupted; the final norm's own weight (dW is correct) and the
# LM head (downstream of it) are not.
RMS_MUST_FAIL = [
    "model.embed_tokens.weight",
    layer(0, "mlp.gate_proj.weight"),
    layer(0, "linear_attn.in_proj_qkv.weight"),
    layer(3, "self_attn.q_proj.weight"),
    layer(3, "self_attn.q_norm.weight"),
    layer(3, "mlp.down_proj.weight"),
]
RMS_MUST_PASS = ["lm_head.weight", "model.norm.weight"]

# The gated norm (DeltaNet layers 0-2) gets dX and dW without silu(z): its own weight and everything
# feeding its input (the delta rule's q/k/v, conv, gates) are corrupted, as is everything in earlier
# layers through the residual stream; the output projection and z (dZ is correct) of the last
# DeltaNet layer, and everything after it, are not.
GATED_MUST_FAIL = [
    *(layer(i, "linear_attn.norm.weight") for i in range(3)),
    layer(2, "linear_attn.in_proj_qkv.weight"),
    layer(2, "linear_attn.conv1d.weight"),
    layer(2, "linear_attn.in_proj_a.weight"),
    layer(2, "linear_attn.in_proj_b.weight"),
    layer(2, "linear_attn.A_log"),
    layer(2, "linear_attn.dt_bias"),
    layer(2, "input_layernorm.weight"),
    layer(1, "mlp.gate_proj.weight"),
    layer(0, "linear_attn.in_proj_z.weight"),
    "model.embed_tokens.weight",
]
GATED_MUST_PASS_RE = re.compile(
    r"^(lm_head\.weight|model\.norm\.weight|model\.layers\.3\..*|model\.layers\.2\.mlp\..*"
    r"|model\.layers\.2\.post_attention_layernorm\.weight"
    r"|model\.layers\.2\.linear_attn\.(out_proj|in_proj_z)\.weight)$"
)

# The short conv's weight gradient alone is wrong (its input gradient is right).
CONV_MUST_FAIL = [layer(i, "linear_attn.conv1d.weight") for i in range(3)]
CONV_MUST_PASS_RE = re.compile(r"^(?!.*conv1d\.weight$).*$")

# The decay gate's gradient (A_log, dt_bias, in_proj_a) is wrong in every DeltaNet layer, and
# through in_proj_a's input gradient everything upstream; the last DeltaNet layer's q/k/v/beta
# side, output side and everything after it are not.
GATE_MUST_FAIL = [
    *(layer(i, f"linear_attn.{t}") for i in range(3) for t in ("A_log", "dt_bias", "in_proj_a.weight")),
    layer(2, "input_layernorm.weight"),
    layer(1, "mlp.down_proj.weight"),
    "model.embed_tokens.weight",
]
LAST_DELTANET_SPARED = r"|model\.layers\.2\.mlp\..*|model\.layers\.2\.post_attention_layernorm\.weight"
GATE_MUST_PASS_RE = re.compile(
    r"^(lm_head\.weight|model\.norm\.weight|model\.layers\.3\..*"
    + LAST_DELTANET_SPARED
    + r"|model\.layers\.2\.linear_attn\.(in_proj_qkv|conv1d|in_proj_b|in_proj_z|out_proj|norm)\.weight)$"
)

# q and k lose their 1/‖x‖: the fused q/k/v projection and the conv of every DeltaNet layer, and
# everything upstream; the gates, z and output side of the last DeltaNet layer are not.
L2_MUST_FAIL = [
    *(layer(i, f"linear_attn.{t}.weight") for i in range(3) for t in ("in_proj_qkv", "conv1d")),
    layer(2, "input_layernorm.weight"),
    "model.embed_tokens.weight",
]
L2_MUST_PASS_RE = re.compile(
    r"^(lm_head\.weight|model\.norm\.weight|model\.layers\.3\..*"
    + LAST_DELTANET_SPARED
    + r"|model\.layers\.2\.linear_attn\.(A_log|dt_bias|in_proj_[abz]\.weight|out_proj\.weight|norm\.weight))$"
)

# A late reset changes the whole delta rule's backward in packed rows: every input of every
# DeltaNet layer's kernel, and everything upstream; the z / output side of the last one is not.
RESET_MUST_FAIL = [
    *(
        layer(i, f"linear_attn.{t}")
        for i in range(3)
        for t in ("in_proj_qkv.weight", "A_log", "in_proj_b.weight")
    ),
    layer(2, "input_layernorm.weight"),
    "model.embed_tokens.weight",
]
RESET_MUST_PASS_RE = re.compile(
    r"^(lm_head\.weight|model\.norm\.weight|model\.layers\.3\..*"
    + LAST_DELTANET_SPARED
    + r"|model\.layers\.2\.linear_attn\.(in_proj_z|out_proj|norm)\.weight)$"
)

EXPECTED = {
    "rmsnorm-dx-no-offset": (RMS_MUST_FAIL, re.compile(r"^(lm_head|model\.norm)\.weight$")),
    "rmsnorm-dx-double-weight": (RMS_MUST_FAIL, re.compile(r"^(lm_head|model\.norm)\.weight$")),
    "gated-norm-pre-gate": (GATED_MUST_FAIL, GATED_MUST_PASS_RE),
    "conv-short-chunk-dw": (CONV_MUST_FAIL, CONV_MUST_PASS_RE),
    "gate-grad-pre-exp": (GATE_MUST_FAIL, GATE_MUST_PASS_RE),
    "l2norm-no-inv-norm": (L2_MUST_FAIL, L2_MUST_PASS_RE),
    "segment-reset-off-by-one": (RESET_MUST_FAIL, RESET_MUST_PASS_RE),
}
PACKED = {"segment-reset-off-by-one"}  # needs packed rows to show


def test_every_known_bug_has_expectations():
    assert set(EXPECTED) == set(KNOWN_BUGS)


def test_clean_run_passes(clean, clean_packed):
    for report in (clean, clean_packed):
        assert report.inject is None and report.reference == "fp64"
        assert report.passed, "\n" + report.table()


# In `make test`: one norm bug and one DeltaNet bug through the whole harness (each bug is a full
# parity run); every bug's kernel-level effect is checked in tests/test_gated_delta.py-style below.
FAST = {"rmsnorm-dx-no-offset", "segment-reset-off-by-one"}


@pytest.mark.parametrize(
    "bug", [b if b in FAST else pytest.param(b, marks=pytest.mark.slow) for b in sorted(KNOWN_BUGS)]
)
def test_injected_bug_keeps_loss_and_fails_gradients(bug: str, hf_dir, clean, clean_packed):
    must_fail, must_pass = EXPECTED[bug]
    segments = 3 if bug in PACKED else 1
    base = clean_packed if bug in PACKED else clean
    report = run_parity(hf_dir, seq_len=SEQ_LEN, batch=BATCH, seed=SEED, inject=bug, segments=segments)
    table = "\n" + report.table(top=80)

    # the forward pass is untouched: same loss as transformers and as the clean kernels
    assert report.inject == bug
    assert report.loss_rel_diff <= 1e-6, table
    assert report.loss_jax == base.loss_jax, table
    assert report.logits_rel == base.logits_rel, table

    # ... but the gradients are not, and the report says so and names them
    assert not report.passed, table
    failing = {e.name: e.ours for e in report.failing_grads}
    missing = [n for n in must_fail if n not in failing]
    assert not missing, f"{bug}: expected failing gradients not reported: {missing}{table}"
    small = {n: failing[n] for n in must_fail if not failing[n] > BIG}
    assert not small, f"{bug}: corrupted gradients should be off by > {BIG}: {small}{table}"
    first = next(e for e in report.grads if e.name == must_fail[0])
    assert f"FAIL {first.ours:.3e}" in report.table(top=len(report.grads))
    assert set(report.to_json()["failing"]) == set(failing)

    # ... and only the gradients the bug can reach
    spared = [e.name for e in report.grads if must_pass.match(e.name)]
    assert spared, must_pass.pattern
    wrongly = {n: failing[n] for n in spared if n in failing}
    assert not wrongly, f"{bug}: gradients outside the bug's reach fail: {wrongly}{table}"
    clean_err = {e.name: e.ours for e in base.grads}
    for e in report.grads:  # unchanged from the clean run, up to float noise
        if e.name in spared:
            assert abs(e.ours - clean_err[e.name]) <= 1e-4, e.name


def _grads(fn, args, bug):
    with inject_bug(bug):
        out, vjp = jax.vjp(fn, *args)
        cot = jax.tree.map(lambda o: jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape)), out)
        return out, vjp(cot)


@pytest.mark.parametrize(
    ("bug", "wrong"),
    [
        ("conv-short-chunk-dw", {"w"}),
        ("gate-grad-pre-exp", {"g"}),
        ("l2norm-no-inv-norm", {"q", "k"}),
        ("segment-reset-off-by-one", {"q", "k", "v", "g", "beta"}),
    ],
)
def test_deltanet_bugs_at_the_kernel(bug, wrong):
    """Forward bit-identical; exactly the named input gradients change."""
    import numpy as np

    from jaxpi.kernels.conv import causal_conv1d
    from jaxpi.kernels.gated_delta import chunk_gated_delta_rule

    rng = np.random.default_rng(0)
    t = 40
    if bug == "conv-short-chunk-dw":
        names = ("x", "w")
        args = (
            jnp.asarray(rng.standard_normal((2, t, 6)), jnp.float32),
            jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
        )

        def fn(x, w):
            return causal_conv1d(x, w)[0]
    else:
        names = ("q", "k", "v", "g", "beta")
        q, k = (jnp.asarray(rng.standard_normal((1, t, 2, 8)), jnp.float32) for _ in range(2))
        v = jnp.asarray(rng.standard_normal((1, t, 4, 8)), jnp.float32)
        g = jnp.asarray(-rng.uniform(0.05, 2.0, (1, t, 4)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, t, 4)), jnp.float32)
        args = (q, k, v, g, beta)
        seg = jnp.asarray((np.arange(t) >= 13) + (np.arange(t) >= 29), jnp.int32)[None]

        def fn(q, k, v, g, beta):
            return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, segment_ids=seg)

    out_c, grads_c = _grads(fn, args, None)
    out_b, grads_b = _grads(fn, args, bug)
    for a, b in zip(jax.tree.leaves(out_c), jax.tree.leaves(out_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name, gc, gb in zip(names, grads_c, grads_b, strict=True):
        err = float(np.linalg.norm(np.asarray(gb) - np.asarray(gc)) / np.linalg.norm(np.asarray(gc)))
        if name in wrong:
            assert err > 1e-2, (bug, name, err)
        else:
            assert err == 0.0, (bug, name, err)
