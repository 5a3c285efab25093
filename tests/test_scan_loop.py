"""The layer-group scan as a real loop (more than `UNROLL_GROUPS` groups, as every model deeper than
8 Qwen3.5 layers, the 27B included): the same function as the same layers run one by one.

The other model tests use at most 9 layers (two groups, fully unrolled), so this is the one place
`make test` runs the looped scan, forward, backward and through the decode cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi import TINY, load_hf
from jaxpi.config import FULL, LINEAR
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.models.qwen3_5 import UNROLL_GROUPS, layer_plan, scan_unroll
from jaxpi.train.step import next_token_loss

# 3 groups of (DeltaNet, attention) in the loop and a DeltaNet tail: the loop as in the default
# pattern's groups of four (3 DeltaNet + 1 attention), in about half the compile time of 13 layers.
CFG = TINY.replace(num_hidden_layers=7, layer_types=(LINEAR, FULL) * 3 + (LINEAR,))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_looped_scan_equals_the_layers_one_by_one(tmp_path):
    period, groups = layer_plan(CFG)
    assert (period, groups) == (2, 3) and groups > UNROLL_GROUPS and scan_unroll(groups) == 1
    ckpt = make_checkpoint(tmp_path / "ckpt", CFG, seed=3)
    looped = load_hf(ckpt)[1]
    plain = load_hf(ckpt, config_overrides={"scan_layers": False})[1]
    assert looped.groups is not None and plain.groups is None
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)), jnp.int32)

    def run(model):
        graphdef, params = nnx.split(model)

        @jax.jit
        def fwd_grad(params):
            loss_fn = lambda p: next_token_loss(nnx.merge(graphdef, p), ids)  # noqa: E731
            loss, grads = jax.value_and_grad(loss_fn)(params)
            return nnx.merge(graphdef, params)(ids), loss, grads

        return fwd_grad(params)

    (lg_loop, loss_loop, g_loop), (lg_plain, loss_plain, g_plain) = run(looped), run(plain)
    # measured: logits 4e-6 apart (the loop's fusion rounds differently), loss to 1e-7
    assert rel(lg_loop, lg_plain) < 1e-4
    assert abs(float(loss_loop) - float(loss_plain)) <= 1e-5 * abs(float(loss_plain))
    # Gradients of the weights outside the stack, and of layer 5 (HF index: group 2, position 1),
    # stacked in one and a tail entry in the other: a wrong slice or carry in the loop's backward
    # would put another layer's gradient here.
    for name in ("embed", "norm", "lm_head"):
        assert rel(g_loop[name][...], g_plain[name][...]) < 1e-3, name
    for part in ("input_norm", "post_norm"):
        got = g_loop["groups"]["blocks"][1][part][...][2]
        want = g_plain["tail"][5][part][...]
        assert rel(got, want) < 1e-3, part
        assert rel(got, g_plain["tail"][3][part][...]) > 0.1  # and not layer 3's (group 1)

    # Prefill 16 tokens, then decode 8 one at a time through the looped cache: the full forward.
    cache = looped.init_cache(2, 32)
    step = jax.jit(lambda m, x, c: m(x, cache=c))
    out, cache = step(looped, ids[:, :16], cache)
    rows = [out]
    for t in range(16, 24):
        out, cache = step(looped, ids[:, t : t + 1], cache)
        rows.append(out)
    assert rel(jnp.concatenate(rows, axis=1), lg_loop) < 1e-4
