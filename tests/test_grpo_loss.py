"""The GRPO policy loss: values and gradients against hand-written formulas, importance cap, masks,
averaging, KL; token logprobs and one LoRA train step on a tiny Qwen3.5."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpi.config import FULL, LINEAR, TINY
from jaxpi.hf_fixtures import seeded_noise
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.rl.loss import (
    GRPOLossConfig,
    grpo_loss,
    kl_estimate,
    make_grpo_loss_fn,
    make_grpo_metrics_fn,
    sequence_logprobs,
    token_logprobs,
    trajectory_weights,
)
from jaxpi.train.step import interleave_microbatches, make_train_step

EPS, EPS_HIGH, CAP = 0.2, 0.28, 1.5


def loss_and_grad(cfg, new, old, engine, adv, mask, ref=None):
    """(loss, d loss / d logp_new, metrics) as numpy."""

    def f(x):
        return grpo_loss(
            x,
            jnp.asarray(old),
            jnp.asarray(engine),
            jnp.asarray(adv),
            jnp.asarray(mask),
            cfg,
            logp_ref=None if ref is None else jnp.asarray(ref),
        )

    # One compiled program per call is faster on CPU than dispatching the ops one by one.
    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(new))
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def hand_built():
    """Three trajectories (A = +1.5, −0.7, +0.9) of 4, 3 and 5 supervised tokens, ratios chosen
    to hit every branch of the min: inside the clip range, above 1 + eps_high and below 1 − eps
    with either sign of A. Engine logprobs put some importance weights above the cap."""
    ratio = np.array(
        [
            [1.00, 1.10, 1.40, 0.70, 0.95, 1.0],  # A > 0: 1.40 clipped (0 grad); 0.70 not (min picks r·A)
            [0.90, 0.60, 1.50, 1.05, 1.00, 1.0],  # A < 0: 0.60 clipped (0 grad); 1.50 not
            [1.25, 1.30, 0.75, 1.02, 0.99, 1.0],  # A > 0: 1.30 > 1.28 clipped; 1.25 inside eps_high
        ]
    )
    mask = np.array(
        [
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0],
        ],
        np.float32,
    )
    adv = np.array([1.5, -0.7, 0.9])
    rng = np.random.default_rng(0)
    old = -rng.uniform(0.1, 3.0, ratio.shape)
    new = old + np.log(ratio)
    # exp(old − engine): 1.0, 0.8, 2.0 (capped), 1.7 (capped), ... per token
    is_w = np.array(
        [
            [1.0, 0.8, 2.0, 1.2, 1.0, 9.0],
            [1.7, 1.0, 0.5, 1.0, 5.0, 1.0],
            [1.1, 1.0, 1.0, 3.0, 0.9, 1.0],
        ]
    )
    engine = old - np.log(is_w)
    return new, old, engine, adv, mask, ratio, is_w


def expected(ratio, w, adv, mask, eps=EPS, eps_high=EPS_HIGH):
    """Loss and gradient by the formulas, token by token."""
    n_i = mask.sum(1)
    counted = n_i > 0
    n = counted.sum()
    loss, grad = 0.0, np.zeros_like(ratio)
    for i in range(ratio.shape[0]):
        if not counted[i]:
            continue
        traj = 0.0
        for t in range(ratio.shape[1]):
            if not mask[i, t]:
                continue
            r, a = ratio[i, t], adv[i]
            clip_active = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps)
            r_used = np.clip(r, 1 - eps, 1 + eps_high) if clip_active else r
            traj += -w[i, t] * r_used * a
            grad[i, t] = 0.0 if clip_active else -a * r * w[i, t] / (n_i[i] * n)
        loss += traj / n_i[i] / n
    return loss, grad


def test_config_validation():
    assert GRPOLossConfig(eps=0.2).clip_high == 0.2
    assert GRPOLossConfig(eps=0.2, eps_high=0.3).clip_high == 0.3
    assert GRPOLossConfig().kl_coef == 0.0  # KL off by default
    for bad, word in (
        (dict(eps=0.0), "eps"),
        (dict(eps=1.0), "eps"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(is_cap=0.5), "is_cap"),
        (dict(is_cap=float("inf")), "is_cap"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(kl_estimator="k4"), "kl_estimator"),
    ):
        with pytest.raises(ValueError, match=word):
            GRPOLossConfig(**bad)


def test_gradient_matches_policy_gradient_formula():
    new, old, engine, adv, mask, ratio, is_w = hand_built()
    cfg = GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP)
    loss, grad, _ = loss_and_grad(cfg, new, old, engine, adv, mask)
    want_loss, want_grad = expected(ratio, np.minimum(is_w, CAP), adv, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)
    # Every branch was exercised: clipped tokens have zero gradient, the others do not.
    clipped = [(0, 2), (1, 1), (2, 1)]
    assert all(grad[ij] == 0.0 for ij in clipped)
    assert np.count_nonzero(grad) == int(mask.sum()) - len(clipped)
    # eps_high ≠ eps matters: with a symmetric clip, ratio 1.25 (A > 0) would be clipped too.
    _, sym_grad, _ = loss_and_grad(GRPOLossConfig(eps=EPS, is_cap=CAP), new, old, engine, adv, mask)
    assert grad[2, 0] != 0.0 and sym_grad[2, 0] == 0.0
    np.testing.assert_allclose(
        sym_grad, expected(ratio, np.minimum(is_w, CAP), adv, mask, eps_high=EPS)[1], rtol=1e-6, atol=1e-9
    )


def test_metrics_on_hand_built_arrays():
    new, old, engine, adv, mask, ratio, is_w = hand_built()
    _, _, m = loss_and_grad(
        GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP), new, old, engine, adv, mask
    )
    on = mask > 0
    n = on.sum()
    diff = np.abs(np.log(is_w))
    np.testing.assert_allclose(m["logp_diff_mean"], diff[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["logp_diff_max"], diff[on].max(), rtol=1e-6)
    assert diff.max() > diff[on].max()  # the largest mismatch sits on a masked token: ignored
    np.testing.assert_allclose(m["ratio_mean"], ratio[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["clip_high_frac"], 2 / n, rtol=1e-6)  # 1.40 and 1.30 with A > 0
    np.testing.assert_allclose(m["clip_low_frac"], 1 / n, rtol=1e-6)  # 0.60 with A < 0
    assert m["n_tokens"] == n and m["n_trajectories"] == 3
    assert "kl_mean" not in m


def test_importance_cap():
    new, old, engine, adv, mask, ratio, is_w = hand_built()
    on = mask > 0
    _, _, m = loss_and_grad(GRPOLossConfig(is_cap=CAP), new, old, engine, adv, mask)
    capped = np.minimum(is_w, CAP)
    assert m["is_weight_max"] == pytest.approx(CAP)
    np.testing.assert_allclose(m["is_weight_mean"], capped[on].mean(), rtol=1e-6)
    # 2.0, 1.7 and 3.0 exceed the cap on supervised tokens (9.0 and 5.0 are masked).
    np.testing.assert_allclose(m["is_capped_frac"], 3 / on.sum(), rtol=1e-6)
    # A cap above every weight is no cap at all.
    _, grad_big, m_big = loss_and_grad(GRPOLossConfig(is_cap=100.0), new, old, engine, adv, mask)
    assert m_big["is_capped_frac"] == 0.0
    np.testing.assert_allclose(
        grad_big, expected(ratio, is_w, adv, mask, eps_high=EPS)[1], rtol=1e-6, atol=1e-9
    )
    # is_cap=None: no correction, w = 1, the same as an engine that agrees with the trainer.
    loss_none, grad_none, m_none = loss_and_grad(GRPOLossConfig(is_cap=None), new, old, engine, adv, mask)
    loss_same, grad_same, _ = loss_and_grad(GRPOLossConfig(is_cap=CAP), new, old, old, adv, mask)
    assert (
        m_none["is_weight_mean"] == 1.0 and m_none["is_weight_max"] == 1.0 and m_none["is_capped_frac"] == 0
    )
    assert m_none["logp_diff_max"] > 0.5  # the mismatch is still reported
    np.testing.assert_allclose(loss_none, loss_same, rtol=1e-6)
    np.testing.assert_allclose(grad_none, grad_same, rtol=1e-6)


def test_masked_tokens_and_empty_trajectories_change_nothing():
    new, old, engine, adv, mask, *_ = hand_built()
    cfg = GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP, kl_coef=0.1)
    ref = old - 0.3
    loss, grad, m = loss_and_grad(cfg, new, old, engine, adv, mask, ref)
    off = mask == 0
    rng = np.random.default_rng(1)
    bumped = [x.copy() for x in (new, old, engine, ref)]
    for x in bumped:
        x[off] = rng.normal(0.0, 50.0, off.sum())
    bumped[2][0, 5] = np.inf  # even non-finite values on prompt/observation tokens are ignored
    bumped[1][1, 4] = np.nan
    new2, old2, engine2, ref2 = bumped
    loss2, grad2, m2 = loss_and_grad(cfg, new2, old2, engine2, adv, mask, ref2)
    assert loss2 == loss and np.array_equal(grad2, grad) and m2 == m
    assert np.all(grad2[off] == 0.0)
    # A fourth trajectory with no supervised tokens (any logprobs, any advantage) is not counted.
    rows = [np.vstack([x, rng.normal(size=(1, x.shape[1]))]) for x in (new, old, engine, ref)]
    loss4, grad4, m4 = loss_and_grad(
        cfg, rows[0], rows[1], rows[2], np.append(adv, np.nan), np.vstack([mask, np.zeros((1, 6))]), rows[3]
    )
    assert loss4 == pytest.approx(loss, rel=1e-6) and m4["n_trajectories"] == 3
    np.testing.assert_allclose(grad4[:3], grad, rtol=1e-6)
    assert np.all(grad4[3] == 0.0)


def test_per_trajectory_mean_then_mean_over_trajectories():
    # Two trajectories of 2 and 4 supervised tokens, no clipping (eps large), w = 1.
    cfg = GRPOLossConfig(eps=0.9, is_cap=None)
    ratio = np.array([[1.2, 0.8, 1.0, 1.0], [1.1, 1.3, 0.9, 0.7]])
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    adv = np.array([2.0, -1.0])
    old = np.full(ratio.shape, -1.0)
    loss, _, _ = loss_and_grad(cfg, old + np.log(ratio), old, old, adv, mask)
    traj1 = -(1.2 * 2 + 0.8 * 2) / 2  # −2.0
    traj2 = -(1.1 + 1.3 + 0.9 + 0.7) * -1.0 / 4  # +1.0
    assert loss == pytest.approx((traj1 + traj2) / 2, rel=1e-6)  # −0.5
    token_mean = (-(1.2 * 2 + 0.8 * 2) + (1.1 + 1.3 + 0.9 + 0.7)) / 6
    assert abs(loss - token_mean) > 0.1  # a plain token mean is another number


def test_on_policy_loss_and_gradient():
    rng = np.random.default_rng(2)
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    adv = np.array([0.4, -0.3, 1.1, 7.0])  # the last trajectory has no supervised tokens
    lp = -rng.uniform(0.1, 2.0, mask.shape)
    loss, grad, m = loss_and_grad(GRPOLossConfig(), lp, lp, lp, adv, mask)
    assert loss == pytest.approx(-np.mean(adv[:3]), rel=1e-6)
    n_i = mask.sum(1)
    want = -adv[:, None] * mask / (np.maximum(n_i, 1)[:, None] * 3)
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    assert m["ratio_mean"] == 1.0 and m["logp_diff_max"] == 0.0 and m["clip_low_frac"] == 0.0


def test_kl_penalty():
    new, old, engine, adv, mask, *_ = hand_built()
    rng = np.random.default_rng(3)
    ref = new + rng.normal(0.0, 0.5, new.shape)
    base = GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP)
    loss0, grad0, _ = loss_and_grad(base, new, old, engine, adv, mask)
    # Off by default: a reference changes nothing but is reported.
    loss_ref, grad_ref, m_ref = loss_and_grad(base, new, old, engine, adv, mask, ref)
    assert loss_ref == loss0 and np.array_equal(grad_ref, grad0)
    q = ref - new
    k3 = np.exp(q) - q - 1.0
    on = mask > 0
    assert np.all(k3 >= 0) and m_ref["kl_mean"] == pytest.approx(k3[on].mean(), rel=1e-5)
    # On: loss += coef · (same averaging of k3); gradient += coef · (1 − exp(q)) / (n_i · N).
    coef = 0.3
    cfg = GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP, kl_coef=coef)
    loss, grad, m = loss_and_grad(cfg, new, old, engine, adv, mask, ref)
    n_i = mask.sum(1, keepdims=True)
    avg_k3 = np.mean((k3 * mask).sum(1, keepdims=True) / n_i)
    assert loss == pytest.approx(loss0 + coef * avg_k3, rel=1e-6)
    np.testing.assert_allclose(m["kl_loss"], avg_k3, rtol=1e-5)
    want = grad0 + coef * (1.0 - np.exp(q)) * mask / (n_i * 3)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="logp_ref"):
        loss_and_grad(cfg, new, old, engine, adv, mask)
    # The estimators: k3 = k2 = k1 = 0 at equal policies; k1 = −q, k2 = q²/2.
    x = jnp.asarray([0.0, 0.5, -1.0])
    np.testing.assert_allclose(kl_estimate(x, x), 0.0)
    np.testing.assert_allclose(kl_estimate(x, x + 0.2, "k1"), -0.2, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(x, x + 0.2, "k2"), 0.02, rtol=1e-5)


def test_shape_errors_name_the_tensor():
    new, old, engine, adv, mask, *_ = hand_built()
    cfg = GRPOLossConfig()
    with pytest.raises(ValueError, match="logp_engine"):
        grpo_loss(
            jnp.asarray(new), jnp.asarray(old), jnp.asarray(engine[:, :-1]), jnp.asarray(adv), mask, cfg
        )
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(engine), jnp.asarray(adv[:2]), mask, cfg)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))


# ---- on the tiny model ----------------------------------------------------------------------------
# Both layer kinds, unrolled (no scanned group to compile): the loss does not depend on depth.
CFG = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))


@pytest.fixture(scope="module")
def lora_model():
    """(graphdef, params): the tiny model with LoRA on every linear layer, every variable seeded
    noise (adapter B non-zero, so gradients reach A too), built abstractly and filled: running
    the initialisers eagerly is slow on CPU."""
    abstract = nnx.eval_shape(
        lambda: add_lora(Qwen3_5ForCausalLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)), LoraConfig(rank=4))
    )
    graphdef, state = nnx.split(abstract)
    return graphdef, seeded_noise(state, 0)


LR = 0.05
GRPO = GRPOLossConfig(is_cap=2.0)


@pytest.fixture(scope="module")
def tiny(lora_model):
    """The model, a rollout batch, and compiled logprob / metrics functions (compiled once)."""
    graphdef, params = lora_model
    logprobs = jax.jit(lambda p, x: sequence_logprobs(nnx.merge(graphdef, p), x))
    metrics = jax.jit(lambda p, b: make_grpo_metrics_fn(GRPO)(nnx.merge(graphdef, p), **b))
    # Rows = trajectories: a prompt, two turns of sampled tokens (mask 1) around an observation
    # (mask 0); old logprobs from the current policy, the engine's slightly off.
    rng = np.random.default_rng(5)
    ids = rng.integers(0, CFG.vocab_size, (4, 16)).astype(np.int32)
    mask = np.zeros(ids.shape, np.int32)
    mask[:, 5:9] = 1  # first turn
    mask[:, 12:] = 1  # second turn, after an observation at 9..11
    mask[1, 14:] = 0
    mask[3] = 0  # an attempt with nothing to learn from (every token an observation)
    lp = np.asarray(logprobs(params, ids))
    batch = {
        "input_ids": ids,
        "loss_mask": mask,
        "logp_old": lp,
        "logp_engine": lp + rng.normal(0.0, 0.05, lp.shape),
        "advantages": np.array([0.5, -0.5, 0.25, 3.0], np.float32),
    }
    return graphdef, params, batch, logprobs, metrics


@pytest.fixture(scope="module")
def one_step(tiny):
    """(params, metrics) after one SGD step of make_train_step with the GRPO loss."""
    graphdef, params, batch, *_ = tiny
    sgd = optax.sgd(LR)
    step = jax.jit(make_train_step(graphdef, sgd, loss_fn=make_grpo_loss_fn(GRPO), trainable=LoRAParam))
    return step(params, sgd.init(nnx.state(params, LoRAParam)), batch)[::2]


def test_token_logprobs_on_tiny_model(tiny):
    graphdef, params, batch, *_ = tiny
    ids = jnp.asarray(batch["input_ids"])
    logits, seq = jax.jit(
        lambda p, x: (nnx.merge(graphdef, p)(x), sequence_logprobs(nnx.merge(graphdef, p), x))
    )(params, ids)  # [B, T, V], [B, T]
    got = token_logprobs(logits[:, :-1], ids[:, 1:])
    want = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], axis=-1), ids[:, 1:, None], axis=-1)[..., 0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert seq.shape == ids.shape and np.all(np.asarray(seq[:, 0]) == 0.0)
    np.testing.assert_allclose(seq[:, 1:], want, atol=1e-6, rtol=0)


def test_train_step_raises_logprob_of_positive_advantage(tiny, one_step):
    _, params, batch, logprobs, metrics_fn = tiny
    metrics = metrics_fn(params, batch)
    # Before the update the policy is the old one: ratio 1, and the loss is −A·(mean capped w)
    # per trajectory, averaged over the three trajectories with supervised tokens.
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    on = batch["loss_mask"][:, 1:] > 0
    w = np.minimum(np.exp(batch["logp_old"] - batch["logp_engine"]), GRPO.is_cap)[:, 1:]
    per_traj = [-a * w[i][on[i]].mean() for i, a in enumerate(batch["advantages"][:3])]
    assert float(metrics["loss"]) == pytest.approx(np.mean(per_traj), rel=1e-5)
    assert 0.0 < float(metrics["logp_diff_mean"]) < 0.1 and float(metrics["n_trajectories"]) == 3
    new, out = one_step
    np.testing.assert_allclose(out["loss"], metrics["loss"], rtol=1e-5)
    assert float(out["grad_norm"]) > 0
    delta = ((np.asarray(logprobs(new, batch["input_ids"])) - batch["logp_old"]) * batch["loss_mask"]).sum(1)
    assert delta[0] > 0 and delta[2] > 0  # positive advantage: sampled tokens more likely
    assert delta[1] < 0  # negative advantage: less likely
    assert float(metrics_fn(new, batch)["loss"]) < float(out["loss"])


def test_trajectory_weights_make_microbatch_losses_add_up():
    """make_train_step weights microbatch j by n_j = Σ weight_fn(microbatch j): with
    `trajectory_weights` that is its number of counted trajectories, and the weighted mean of the
    microbatch losses is the loss of one batch of all rows (a token count would not be)."""
    new, old, engine, adv, mask, *_ = hand_built()
    rows = [np.vstack([x, np.full((1, 6), -1.0)]) for x in (new, old, engine)]
    adv, mask = np.append(adv, 2.0), np.vstack([mask, np.zeros((1, 6))])  # a 4th, empty trajectory
    ids = np.zeros((4, 7), np.int32)
    loss_mask = np.pad(mask, ((0, 0), (1, 0))).astype(np.int32)  # targets are ids[:, 1:]
    np.testing.assert_array_equal(np.asarray(trajectory_weights(ids, loss_mask))[:, 0], [1, 1, 1, 0])
    cfg = GRPOLossConfig(eps=EPS, eps_high=EPS_HIGH, is_cap=CAP)

    def loss(sel):
        return float(grpo_loss(*(jnp.asarray(x[sel]) for x in (*rows, adv, mask)), cfg)[0])

    parts = [np.array([0, 2]), np.array([1, 3])]
    n_traj = [float(jnp.sum(trajectory_weights(ids[p], loss_mask[p]))) for p in parts]
    n_tok = [float(mask[p].sum()) for p in parts]
    full = loss(np.arange(4))
    assert n_traj == [2.0, 1.0]
    assert np.dot(n_traj, [loss(p) for p in parts]) / sum(n_traj) == pytest.approx(full, rel=1e-6)
    assert abs(np.dot(n_tok, [loss(p) for p in parts]) / sum(n_tok) - full) > 1e-2


@pytest.mark.slow
def test_accumulation_weights_by_trajectories(tiny, one_step):
    """Two microbatches, one holding the trajectory with no supervised tokens: weighted by counted
    trajectories (`trajectory_weights`) they make the same update as one batch of all rows."""
    graphdef, params, full, *_ = tiny
    micro = [{k: v[j::2] for k, v in full.items()} for j in range(2)]
    batch = interleave_microbatches(micro)
    np.testing.assert_array_equal(np.asarray(trajectory_weights(**batch))[:, 0], [1, 1, 1, 0])
    sgd = optax.sgd(LR)
    step = jax.jit(
        make_train_step(
            graphdef,
            sgd,
            loss_fn=make_grpo_loss_fn(GRPO),
            trainable=LoRAParam,
            accum_steps=2,
            weight_fn=trajectory_weights,
        )
    )
    new, _, out = step(params, sgd.init(nnx.state(params, LoRAParam)), batch)
    want_params, want = one_step
    assert float(out["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)
    before = jax.tree.leaves(nnx.state(params, LoRAParam))
    got_leaves, want_leaves = (
        jax.tree.leaves(nnx.state(new, LoRAParam)),
        jax.tree.leaves(nnx.state(want_params, LoRAParam)),
    )
    for g, w, b in zip(got_leaves, want_leaves, before, strict=True):
        upd_got, upd_want = np.asarray(g) - np.asarray(b), np.asarray(w) - np.asarray(b)
        np.testing.assert_allclose(upd_got, upd_want, rtol=1e-4, atol=1e-4 * np.abs(upd_want).max())
