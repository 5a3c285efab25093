"""The GRPO policy loss as pure functions: token-level clipped surrogate, capped importance
correction between the rollout engine and the trainer, optional KL to a reference policy.

Per token t of trajectory i (supervised tokens only: the model's own sampled tokens; prompt,
tool/environment observations and padding are masked out):

    r[i,t]  = exp(logp_new − logp_old)                       trainable / old policy (trainer numerics)
    w[i,t]  = sg(min(exp(logp_old − logp_engine), is_cap))   engine → trainer importance weight
    pg[i,t] = −w · min(r·A_i, clip(r, 1 − eps, 1 + eps_high)·A_i)
    kl[i,t] = exp(q) − q − 1,   q = logp_ref − logp_new      ("k3": unbiased, ≥ 0, low variance)
    ℓ[i,t]  = pg + kl_coef · kl

    loss = 1/|I| Σ_{i∈I} 1/n_i Σ_t m[i,t]·ℓ[i,t]      n_i = Σ_t m[i,t],   I = {i : n_i > 0}

`sg` is stop-gradient. The data was sampled by the rollout engine's copy of the weights, while
`logp_old` is the trainer's recomputation of the same policy with its own numerics (kernels,
precision, sharding); `w` corrects for that mismatch and the cap bounds its variance (truncated
importance sampling). `is_cap = None` turns the correction off (w = 1). A trajectory with no
supervised tokens contributes nothing and is not counted in |I|.

Gradient of the loss w.r.t. `logp_new[i,t]` (the policy gradient where the clip is inactive):

    ∂loss/∂logp_new = −A_i·r·w / (n_i·|I|)     where the min picks the unclipped branch, else 0
                    + kl_coef·(1 − exp(q)) / (n_i·|I|)

The clip is active (and the gradient of the surrogate 0) where A > 0 and r > 1 + eps_high, or
A < 0 and r < 1 − eps.

Alignment: `token_logprobs(logits, targets)` scores `targets[b, t]` with `logits[b, t]`. Model
batches follow `next_token_loss`: logits at position t predict `input_ids[t+1]`, and every per-token
array of a batch (`loss_mask`, `logp_old`, `logp_engine`, `logp_ref`) is indexed by the position of
the token it is about, `[B, T]`, so `logp_old[b, t] = log π_old(ids[b, t] | ids[b, <t])`; column 0
is never predicted and is ignored. `sequence_logprobs` returns arrays in that layout.
One row holds one trajectory (`advantages` is `[B]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.kernels.lm_head import lm_head_weight, target_logprobs
from jaxpi.train.step import loss_chunk, target_weights

Metrics = dict[str, jax.Array]
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Hyperparameters of `grpo_loss`.

    `eps`: lower clip range (ratio floor 1 − eps). `eps_high`: upper clip range (ratio ceiling
    1 + eps_high; None = eps, the symmetric PPO clip; a larger value is DAPO's "clip higher").
    `is_cap`: cap on the engine → trainer importance weight (None = no correction, w = 1; 2 is
    a common truncated-importance-sampling cap).
    `kl_coef`: weight of the KL penalty to the reference policy (0 = off; then no reference
    logprobs are needed). `kl_estimator`: per-token estimator of KL(π_θ ‖ π_ref) from samples of
    π_θ, with q = logp_ref − logp_new: "k3" = exp(q) − q − 1 (GRPO, DeepSeekMath; unbiased and
    ≥ 0), "k1" = −q (unbiased, can be negative), "k2" = q²/2 (biased, ≥ 0).
    """

    eps: float = 0.2
    eps_high: float | None = None
    is_cap: float | None = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eps) and 0.0 < self.eps < 1.0):
            raise ValueError(f"GRPO eps must be in (0, 1), got {self.eps}")
        if self.eps_high is not None and not (math.isfinite(self.eps_high) and self.eps_high > 0.0):
            raise ValueError(f"GRPO eps_high must be > 0 (or None for eps), got {self.eps_high}")
        # A cap below 1 would down-weight every token even when engine and trainer agree exactly.
        if self.is_cap is not None and not (math.isfinite(self.is_cap) and self.is_cap >= 1.0):
            raise ValueError(f"GRPO is_cap must be >= 1 (or None for no correction), got {self.is_cap}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ValueError(f"GRPO kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"GRPO kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")

    @property
    def clip_high(self) -> float:
        return self.eps if self.eps_high is None else self.eps_high


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`log softmax(logits)[b, t, targets[b, t]]` in ≥ fp32, `[B, T]` from `[B, T, V]` logits.

    Computed as logsumexp − gathered logit, so the `[B, T, V]` log-probabilities are never
    materialised. For next-token logprobs pass `logits[:, :-1]` and `input_ids[:, 1:]` (the logit
    at position t predicts token t+1), or use `sequence_logprobs`.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {logits.shape} do not match targets {targets.shape}")
    # bf16 logits upcast, fp64 (numerical checks) kept, as in next_token_loss.
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def sequence_logprobs(
    model: nnx.Module,
    input_ids: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """`out[b, t] = log π(ids[b, t] | ids[b, <t])`, `[B, T]`, with `out[:, 0] = 0` (nothing
    predicts the first token): the batch layout of `logp_old` / `logp_engine` / `logp_ref`."""
    kw = {} if dropout_key is None else {"dropout_key": dropout_key}
    chunk = loss_chunk(model)
    hidden, _ = model.hidden_states(input_ids, positions, segment_ids, **kw)
    if chunk:  # the LM head a chunk of positions at a time (QwenConfig.loss_chunk)
        lp = target_logprobs(hidden[:, :-1], lm_head_weight(model), input_ids[:, 1:], chunk=chunk)
    else:
        logits = model.logits(hidden[:, :-1])  # [B, T-1, V]: the head on the predicting positions only
        lp = token_logprobs(logits, input_ids[:, 1:])  # [B, T-1]
    return jnp.pad(lp, ((0, 0), (1, 0)))


def _check(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"grpo_loss: {name} has shape {tuple(x.shape)}, expected {shape}")


def _masked_mean(x: jax.Array, m: jax.Array) -> jax.Array:
    """Token mean over supervised tokens of the whole batch (metrics)."""
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def _masked_max(x: jax.Array, m: jax.Array) -> jax.Array:
    """Max over supervised tokens of a non-negative quantity (0 when none)."""
    return jnp.max(jnp.where(m > 0, x, 0.0))


def kl_estimate(logp_new: jax.Array, logp_ref: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by π_θ (see `GRPOLossConfig`)."""
    q = logp_ref - logp_new
    if estimator == "k3":
        return jnp.expm1(q) - q  # exp(q) − 1 − q without cancellation near q = 0
    if estimator == "k2":
        return 0.5 * q * q
    if estimator == "k1":
        return -q
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def grpo_loss(
    logp_new: jax.Array,
    logp_old: jax.Array,
    logp_engine: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: GRPOLossConfig,
    *,
    logp_ref: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """(scalar loss, metrics) of the module docstring's objective.

    Per-token arrays are `[B, T]`, aligned with each other (entry t is about the same predicted
    token in all of them); `mask` is 1 on supervised generated tokens; `advantages` is `[B]`, one
    per trajectory (row). Only `logp_new` should carry gradients: the others are stopped.
    Masked entries may hold anything (even inf/nan): they are replaced before any arithmetic,
    so they change neither the loss nor any gradient.

    Metrics (token means / maxima over supervised tokens of the batch): `logp_diff_mean`,
    `logp_diff_max` (|logp_old − logp_engine|), `is_weight_mean`, `is_weight_max`,
    `is_capped_frac`, `clip_low_frac`, `clip_high_frac` (tokens whose clipped branch is the one
    taken), `ratio_mean`, `pg_loss`, `n_tokens`, `n_trajectories`, and with `logp_ref` given
    `kl_mean` (and `kl_loss`, the averaged KL term before `kl_coef`).
    """
    shape = tuple(logp_new.shape)
    if len(shape) != 2:
        raise ValueError(f"grpo_loss: logp_new must be [B, T], got shape {shape}")
    for name, x in (("logp_old", logp_old), ("logp_engine", logp_engine), ("mask", mask)):
        _check(name, x, shape)
    _check("advantages", advantages, shape[:1])
    if logp_ref is not None:
        _check("logp_ref", logp_ref, shape)
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs logp_ref (the reference policy's logprobs)")

    f32 = jnp.promote_types(logp_new.dtype, jnp.float32)
    m = mask.astype(f32)
    on = m > 0

    # Zero the masked entries first (not just the products): where() passes no gradient to the
    # branch it drops, but exp(inf) · 0 in that branch would still make the gradient nan.
    def clean(x: jax.Array) -> jax.Array:
        return jnp.where(on, x.astype(f32), 0.0)

    new = clean(logp_new)
    old = jax.lax.stop_gradient(clean(logp_old))
    engine = jax.lax.stop_gradient(clean(logp_engine))
    n_tok = jnp.sum(m, axis=1)  # [B] supervised tokens per trajectory
    has = n_tok > 0
    # A trajectory without supervised tokens may carry any advantage (nan included): it is unused.
    adv = jax.lax.stop_gradient(jnp.where(has, advantages.astype(f32), 0.0))[:, None]  # [B, 1]

    ratio = jnp.exp(new - old)
    lo, hi = 1.0 - cfg.eps, 1.0 + cfg.clip_high
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, lo, hi) * adv
    surrogate = jnp.minimum(unclipped, clipped)

    raw_w = jnp.exp(old - engine)
    weight = jnp.ones_like(raw_w) if cfg.is_cap is None else jnp.minimum(raw_w, cfg.is_cap)
    per_token = -weight * surrogate  # [B, T]

    kl = None
    if logp_ref is not None:
        kl = kl_estimate(new, jax.lax.stop_gradient(clean(logp_ref)), cfg.kl_estimator)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl

    # Per-trajectory mean over its supervised tokens, then mean over trajectories that have any.
    n_traj = jnp.sum(has.astype(f32))

    def average(x: jax.Array) -> jax.Array:
        per_traj = jnp.sum(x * m, axis=1) / jnp.maximum(n_tok, 1.0)  # [B]
        return jnp.sum(jnp.where(has, per_traj, 0.0)) / jnp.maximum(n_traj, 1.0)

    loss = average(per_token)

    metrics: Metrics = {
        "pg_loss": average(-weight * surrogate),
        "ratio_mean": _masked_mean(ratio, m),
        "clip_low_frac": _masked_mean(((ratio < lo) & (adv < 0)).astype(f32), m),
        "clip_high_frac": _masked_mean(((ratio > hi) & (adv > 0)).astype(f32), m),
        "logp_diff_mean": _masked_mean(jnp.abs(old - engine), m),
        "logp_diff_max": _masked_max(jnp.abs(old - engine), m),
        "is_weight_mean": _masked_mean(weight, m),
        "is_weight_max": _masked_max(weight, m),
        "is_capped_frac": (
            jnp.zeros((), f32) if cfg.is_cap is None else _masked_mean((raw_w > cfg.is_cap).astype(f32), m)
        ),
        "n_tokens": jnp.sum(m),
        "n_trajectories": n_traj,
    }
    if kl is not None:
        metrics["kl_mean"] = _masked_mean(kl, m)
        metrics["kl_loss"] = average(kl)
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def trajectory_weights(
    input_ids: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array | None = None, **_: Any
) -> jax.Array:
    """`[B, 1]`: 1 for each trajectory with at least one supervised token — the `weight_fn` for
    `make_train_step(accum_steps=k)`, whose microbatch losses are then weighted by the number of
    trajectories they average over, as one batch of all rows would be."""
    w = target_weights(input_ids, loss_mask, segment_ids)
    return (jnp.sum(w, axis=1, keepdims=True) > 0).astype(jnp.float32)


GRPOLossFn = Callable[..., jax.Array]
GRPOMetricsFn = Callable[..., Metrics]


def grpo_model_loss(
    model: nnx.Module,
    input_ids: jax.Array,
    loss_mask: jax.Array,
    logp_old: jax.Array,
    logp_engine: jax.Array,
    advantages: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    logp_ref: jax.Array | None = None,
    *,
    cfg: GRPOLossConfig,
) -> tuple[jax.Array, Metrics]:
    """`grpo_loss` of a model on a batch: (loss, metrics).

    Batch layout (module docstring): `input_ids`, `loss_mask` (1 on the model's sampled tokens),
    `logp_old`, `logp_engine`, `logp_ref` are `[B, T]` indexed like `input_ids`; `advantages` is
    `[B]`. With `segment_ids`, no token is predicted across a segment boundary (as in
    `next_token_loss`); a row is still one trajectory.
    """
    shape = tuple(input_ids.shape)
    named = {"loss_mask": loss_mask, "logp_old": logp_old, "logp_engine": logp_engine, "logp_ref": logp_ref}
    for name, x in named.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(
                f"GRPO batch: {name} has shape {tuple(x.shape)}, expected {shape} like input_ids"
            )
    new = sequence_logprobs(model, input_ids, segment_ids, positions, dropout_key)[:, 1:]  # [B, T-1]
    mask = target_weights(input_ids, loss_mask, segment_ids)  # [B, T-1], targets ids[:, 1:]
    ref = None if logp_ref is None else logp_ref[:, 1:]
    return grpo_loss(new, logp_old[:, 1:], logp_engine[:, 1:], advantages, mask, cfg, logp_ref=ref)


def make_grpo_loss_fn(cfg: GRPOLossConfig) -> GRPOLossFn:
    """`loss_fn(model, input_ids, loss_mask, logp_old, logp_engine, advantages, segment_ids=None,
    positions=None, dropout_key=None, logp_ref=None) -> scalar loss` (`grpo_model_loss`'s loss)
    for `make_train_step(graphdef, optimizer, loss_fn=..., trainable=LoRAParam)`.

    make_train_step keeps only a scalar, so the metrics come from `make_grpo_metrics_fn` (another
    forward pass, e.g. before the update, where ratio = 1). With gradient accumulation pass
    `weight_fn=trajectory_weights`.
    """

    def loss_fn(model: nnx.Module, *args: jax.Array | None, **batch: jax.Array | None) -> jax.Array:
        return grpo_model_loss(model, *args, cfg=cfg, **batch)[0]

    return loss_fn


def make_grpo_metrics_fn(cfg: GRPOLossConfig) -> GRPOMetricsFn:
    """`metrics_fn(model, **batch) -> {"loss", **grpo_loss metrics}` on the batch of
    `make_grpo_loss_fn` (no gradients; jit it)."""

    def metrics_fn(model: nnx.Module, *args: jax.Array | None, **batch: jax.Array | None) -> Metrics:
        loss, metrics = grpo_model_loss(model, *args, cfg=cfg, **batch)
        return {"loss": loss, **metrics}

    return metrics_fn
