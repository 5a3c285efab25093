"""The parity harness catches fused-norm backward bugs that keep the loss: for each of `KNOWN_BUGS`,
`run_parity(..., inject=bug)` reproduces transformers' loss exactly, yet fails, and names the
parameters whose gradients the bug corrupts (and only those).

One TINY checkpoint (layers 0-2 Gated DeltaNet, layer 3 attention) and one clean run are shared.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import pytest

from jaxpi.config import TINY
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.kernels.norms import KNOWN_BUGS
from jaxpi.parity import run_parity

SEQ_LEN, BATCH, SEED = 48, 2, 0
BIG = 1e-2  # a corrupted gradient is off by far more than the 1e-3 fp32 threshold


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("inject") / "tiny", TINY, seed=7)


@pytest.fixture(scope="module")
def clean(hf_dir):
    return run_parity(hf_dir, seq_len=SEQ_LEN, batch=BATCH, seed=SEED)


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

EXPECTED = {
    "rmsnorm-dx-no-offset": (RMS_MUST_FAIL, re.compile(r"^(lm_head|model\.norm)\.weight$")),
    "rmsnorm-dx-double-weight": (RMS_MUST_FAIL, re.compile(r"^(lm_head|model\.norm)\.weight$")),
    "gated-norm-pre-gate": (GATED_MUST_FAIL, GATED_MUST_PASS_RE),
}


def test_every_known_bug_is_exercised():
    assert set(EXPECTED) == set(KNOWN_BUGS)


def test_clean_run_passes(clean):
    assert clean.inject is None
    assert clean.passed, "\n" + clean.table()


# One bug in `make test` (the harness's capability); each further bug is another full parity run.
@pytest.mark.parametrize(
    "bug",
    [b if i == 0 else pytest.param(b, marks=pytest.mark.slow) for i, b in enumerate(sorted(KNOWN_BUGS))],
)
def test_injected_bug_keeps_loss_and_fails_gradients(bug: str, hf_dir, clean):
    must_fail, must_pass = EXPECTED[bug]
    report = run_parity(hf_dir, seq_len=SEQ_LEN, batch=BATCH, seed=SEED, inject=bug)
    print(report.table(top=60))
    table = "\n" + report.table(top=60)

    # the forward pass is untouched: same loss as transformers and as the clean kernels
    assert report.inject == bug
    assert report.loss_rel_diff <= 1e-6, table
    assert report.loss_jax == clean.loss_jax, table
    assert report.logits_rel == clean.logits_rel, table

    # ... but the gradients are not, and the report says so and names them
    assert not report.passed, table
    failing = dict(report.failing_grads)
    missing = [n for n in must_fail if n not in failing]
    assert not missing, f"{bug}: expected failing gradients not reported: {missing}{table}"
    small = {n: failing[n] for n in must_fail if not failing[n] > BIG}
    assert not small, f"{bug}: corrupted gradients should be off by > {BIG}: {small}{table}"
    assert f"FAIL {failing[must_fail[0]]:.3e}  {must_fail[0]}" in report.table(top=len(report.grads))
    assert set(report.to_json()["failing"]) == set(failing)

    # ... and only the gradients the bug can reach
    spared = [n for n, _ in report.grads if must_pass.match(n)]
    assert spared, must_pass.pattern
    wrongly = {n: e for n, e in report.grads if n in spared and n in failing}
    assert not wrongly, f"{bug}: gradients outside the bug's reach fail: {wrongly}{table}"
    clean_err = dict(clean.grads)
    for n in spared:  # unchanged from the clean run, up to float noise
        assert abs(dict(report.grads)[n] - clean_err[n]) <= 1e-4, n
