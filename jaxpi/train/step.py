"""One training step as pure functions: next-token loss, gradients, optax update, sharded jit.

    params, opt_state, batch  →  params', opt_state', {loss, grad_norm}

`params` is an `nnx.State` (from `nnx.split(model, ...)`); the `trainable` filter picks the part
that is differentiated and updated (all `nnx.Param`s by default; a LoRA trainer passes its adapter
type) and the optimizer state mirrors that part only. The rest (frozen weights) is read, passed
through unchanged, and costs no optimizer memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sharding.strategies import Fallbacks, MeshLike, Strategy, with_activation_constraints

Batch = Mapping[str, jax.Array]
LossFn = Callable[..., jax.Array]  # loss_fn(model, **batch) -> scalar
Metrics = dict[str, jax.Array]
TrainStep = Callable[[nnx.State, Any, Batch], tuple[nnx.State, Any, Metrics]]


def next_token_loss(
    model: nnx.Module,
    input_ids: jax.Array,
    loss_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Mean cross-entropy of token t+1 given tokens ≤ t, over supervised positions.

        nll[b, t] = logsumexp(z[b, t]) - z[b, t, ids[b, t+1]]          z = logits in ≥ fp32
        w[b, t]   = loss_mask[b, t+1] · [segment_ids[b, t+1] == segment_ids[b, t]]
        loss      = Σ w · nll / max(Σ w, 1)

    `loss_mask` marks the tokens to predict (e.g. completion tokens; 0 on prompt and padding);
    with packed rows the first token of a segment is never predicted from the previous one.
    """
    logits = model(input_ids, segment_ids=segment_ids)[:, :-1]  # [B, T-1, V]
    targets = input_ids[:, 1:]
    # logsumexp − target logit is log-softmax without materialising [B, T, V] log-probs in fp32
    # (for a 248k vocabulary that array dwarfs the model's other activations). At least fp32:
    # bf16 logits are upcast, fp64 ones (numerical checks) kept.
    z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    w = jnp.ones(targets.shape, jnp.float32)
    if loss_mask is not None:
        w = w * loss_mask[:, 1:].astype(jnp.float32)
    if segment_ids is not None:
        w = w * (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def split_trainable(
    params: nnx.State, trainable: nnx.filterlib.Filter = nnx.Param
) -> tuple[nnx.State, nnx.State]:
    """(trainable part, the rest) of a state; `nnx.merge_state` puts them back together."""
    train, rest = nnx.split_state(params, trainable, ...)
    return train, rest


def init_opt_state(
    optimizer: optax.GradientTransformation, params: nnx.State, *, trainable: nnx.filterlib.Filter = nnx.Param
) -> Any:
    """The optimizer state for the trainable part of `params` (jit it with `out_shardings` to
    create it sharded; `jax.eval_shape` it to plan)."""
    return optimizer.init(split_trainable(params, trainable)[0])


def loss_and_grads(
    graphdef: nnx.GraphDef, *, loss_fn: LossFn = next_token_loss, trainable: nnx.filterlib.Filter = nnx.Param
) -> Callable[[nnx.State, Batch], tuple[jax.Array, nnx.State]]:
    """`fn(params, batch) -> (loss, grads)`, grads shaped like the trainable part of `params`."""

    def fn(params: nnx.State, batch: Batch) -> tuple[jax.Array, nnx.State]:
        train, rest = split_trainable(params, trainable)

        def loss(train: nnx.State) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, train, rest), **batch)

        return jax.value_and_grad(loss)(train)

    return fn


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: LossFn = next_token_loss,
    trainable: nnx.filterlib.Filter = nnx.Param,
) -> TrainStep:
    """`step(params, opt_state, batch) -> (params, opt_state, {"loss", "grad_norm"})`.

    `batch` holds the keyword arguments of `loss_fn` after the model (`input_ids`, optionally
    `loss_mask`, `segment_ids`). The step is pure: jit it (`jit_train_step`) or `eval_shape` it.
    """
    grad_fn = loss_and_grads(graphdef, loss_fn=loss_fn, trainable=trainable)

    def step(params: nnx.State, opt_state: Any, batch: Batch) -> tuple[nnx.State, Any, Metrics]:
        loss, grads = grad_fn(params, batch)
        train, rest = split_trainable(params, trainable)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        # fp32 norm whatever the gradient dtype (a bf16 sum of squares loses the metric).
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        return nnx.merge_state(train, rest), opt_state, metrics

    return step


def jit_train_step(
    step: TrainStep,
    param_shardings: nnx.State,
    opt_shardings: Any,
    batch_sharding: Any,
    mesh: MeshLike,
    strategy: Strategy,
    *,
    fallbacks: Fallbacks | None = None,
) -> Any:
    """`jax.jit(step)` with the strategy's shardings: params and optimizer state keep their
    shardings across the step and are donated (updated in place), the batch is split as
    `batch_sharding` says, metrics come back replicated, and the model's activation
    constraints follow the strategy (the resolver is installed while jit traces).

    `batch_sharding` is one sharding for every batch array, or a dict like the batch.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        with_activation_constraints(step, strategy, mesh, fallbacks=fallbacks),
        in_shardings=(param_shardings, opt_shardings, batch_sharding),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )
