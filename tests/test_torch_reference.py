"""The float64 arbiter is float64 throughout, and jaxpi in float64 computes the same function.

`transformers` upcasts to float32 inside its norms, rotary tables, softmax, decay gate and the
whole chunked gated delta rule, so a model loaded with dtype=float64 still rounds like float32
there (and a ConditionalGeneration's towers come from the original classes through AutoModel).
If any of that were left, the two float64 runs below would differ by ~1e-7; they agree to
~1e-15, which only two double-precision computations of the same function can.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from jaxpi.convert.hf import load_hf
from jaxpi.hf_fixtures import make_hf_checkpoint
from jaxpi.parity import _rel, jax_reference
from jaxpi.torch_reference import _widen, reference_grads

TEXT = {
    "vocab_size": 96,
    "hidden_size": 24,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "pad_token_id": 0,
}


@pytest.mark.parametrize("kind", ["causal", "conditional"])
def test_float64_reference_equals_jaxpi_float64(kind, tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / kind, TEXT, kind=kind, seed=3)
    ids = np.random.default_rng(0).integers(0, TEXT["vocab_size"], (2, 70))  # two 64-token chunks
    logits_t, loss_t, grads_t = reference_grads(hf_dir, ids, "float64")
    with jax.enable_x64(True):
        _, model = load_hf(hf_dir, dtype="float64")
        logits_j, loss_j, _ = jax_reference(model, ids)
    assert logits_j.dtype == np.float64
    # float32 anywhere in either run: ~1e-7 (the plain transformers model in float64: 2e-8)
    assert _rel(logits_j, logits_t) < 1e-13, _rel(logits_j, logits_t)
    assert abs(loss_j - loss_t) < 1e-13 * abs(loss_t)
    _, _, grads_32 = reference_grads(hf_dir, ids, "float32")
    assert set(grads_32) == set(grads_t)
    assert not any(n.startswith("model.visual.") for n in grads_t)  # the tower gets no gradient
    # and torch's own float32 run is an independent, float32-sized distance away
    worst = max(_rel(grads_32[n], grads_t[n]) for n in grads_t if np.any(grads_t[n]))
    assert 1e-8 < worst < 1e-4, worst


def test_widening_refuses_a_changed_source():
    source = (
        "x.to(torch.float32) " * 4
        + "dtype=torch.float32) " * 1
        + ".float() " * 11
        + "dtype=torch.float) " * 4
        + "AutoModel.from_config(config.text_config) AutoModel.from_config(config.vision_config)"
    )
    widened = _widen(source)
    assert "float32" not in widened and ".float()" not in widened
    assert "Qwen3_5TextModel._from_config(config.text_config)" in widened
    with pytest.raises(RuntimeError, match="upcasts changed"):
        _widen(source + " y.float()")
    with pytest.raises(RuntimeError, match="AutoModel"):
        _widen(source.replace("AutoModel.from_config(config.vision_config)", ""))
