"""One training step as pure functions: next-token loss, gradients, optax update, sharded jit.

    params, opt_state, batch  →  params', opt_state', {loss, grad_norm}

`params` is an `nnx.State` (from `nnx.split(model, ...)`); the `trainable` filter picks the part
that is differentiated and updated (all `nnx.Param`s by default; a LoRA trainer passes its adapter
type) and the optimizer state mirrors that part only. The rest (frozen weights) is read, passed
through unchanged, and costs no optimizer memory. Gradient accumulation runs the microbatches
inside the one jitted step (token-weighted, one optimizer update).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpi.kernels.lm_head import lm_head_weight, target_logprobs
from sharding.strategies import Fallbacks, MeshLike, Strategy, with_activation_constraints

Batch = Mapping[str, jax.Array]
LossFn = Callable[..., jax.Array]  # loss_fn(model, **batch) -> scalar
Metrics = dict[str, jax.Array]
TrainStep = Callable[..., tuple[nnx.State, Any, Metrics]]  # (params, opt_state, batch[, key])
WeightFn = Callable[..., jax.Array]  # weight_fn(**batch) -> per-token loss weights


def next_token_loss(
    model: nnx.Module,
    input_ids: jax.Array,
    loss_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Mean cross-entropy of token t+1 given tokens ≤ t, over supervised positions.

        nll[b, t] = logsumexp(z[b, t]) - z[b, t, ids[b, t+1]]          z = logits in ≥ fp32
        w[b, t]   = loss_mask[b, t+1] · [segment_ids[b, t+1] == segment_ids[b, t]]
        loss      = Σ w · nll / max(Σ w, 1)

    `loss_mask` marks the tokens to predict (e.g. completion tokens; 0 on prompt and padding);
    with packed rows the first token of a segment is never predicted from the previous one.
    `dropout_key` (LoRA dropout) is passed to the model only when given, so models without
    dropout keep working.
    """
    kw = {} if dropout_key is None else {"dropout_key": dropout_key}
    targets = input_ids[:, 1:]
    chunk = loss_chunk(model)
    hidden, _ = model.hidden_states(input_ids, positions, segment_ids, **kw)
    if chunk:
        # The LM head a chunk of positions at a time: the [B, T, V] logits never exist whole.
        nll = -target_logprobs(hidden[:, :-1], lm_head_weight(model), targets, chunk=chunk)
    else:
        # The head on the T-1 predicting positions: slicing [B, T, V] logits instead would copy them.
        logits = model.logits(hidden[:, :-1])  # [B, T-1, V]
        # logsumexp − target logit is log-softmax without materialising [B, T, V] log-probs in fp32
        # (for a 248k vocabulary that array dwarfs the model's other activations). At least fp32:
        # bf16 logits are upcast, fp64 ones (numerical checks) kept.
        z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    w = target_weights(input_ids, loss_mask, segment_ids)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def loss_chunk(model: nnx.Module) -> int:
    """The model config's `loss_chunk` (0 for models without one: the LM head at once)."""
    return int(getattr(getattr(model, "cfg", None), "loss_chunk", 0))


def target_weights(
    input_ids: jax.Array, loss_mask: jax.Array | None = None, segment_ids: jax.Array | None = None, **_: Any
) -> jax.Array:
    """`w[b, t]` of `next_token_loss`: 1 where token t+1 is predicted, `[B, T-1]` float32."""
    w = jnp.ones(input_ids[:, 1:].shape, jnp.float32)
    if loss_mask is not None:
        w = w * loss_mask[:, 1:].astype(jnp.float32)
    if segment_ids is not None:
        w = w * (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(jnp.float32)
    return w


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
    accum_steps: int = 1,
    weight_fn: WeightFn = target_weights,
) -> TrainStep:
    """`step(params, opt_state, batch, key=None) -> (params, opt_state, {"loss", "grad_norm"})`.

    `batch` holds the keyword arguments of `loss_fn` after the model (`input_ids`, optionally
    `loss_mask`, `segment_ids`, `positions`). With `key`, `loss_fn` also gets `dropout_key`
    (folded with the microbatch index). The step is pure: jit it (`jit_train_step`) or
    `eval_shape` it.

    Gradient accumulation (`accum_steps = k`): the batch holds k microbatches of b rows as
    `[b·k, ...]` arrays, microbatch j being rows `j, j+k, j+2k, ...` (`interleave_microbatches`
    lays them out; this keeps each device's rows on that device when the batch is split over
    rows). The microbatches run one after another under `lax.scan` (activation memory of one),
    and their losses and gradients are weighted by supervised tokens,

        loss = Σ_j n_j · loss_j / Σ_j n_j        n_j = Σ weight_fn(microbatch j)

    so that k microbatches give the same update as one batch of all their rows. One optimizer
    update per step.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    grad_fn = loss_and_grads(graphdef, loss_fn=loss_fn, trainable=trainable)

    def one(params: nnx.State, batch: Batch, key: jax.Array | None) -> tuple[jax.Array, nnx.State]:
        return grad_fn(params, batch if key is None else {**batch, "dropout_key": key})

    def accumulated(params: nnx.State, batch: Batch, key: jax.Array | None) -> tuple[jax.Array, nnx.State]:
        k = accum_steps

        def split(x: jax.Array) -> jax.Array:
            if x.shape[0] % k:
                raise ValueError(f"batch of {x.shape[0]} rows does not split into {k} microbatches")
            return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)  # [k, b, ...]

        micro = {name: split(x) for name, x in batch.items()}
        n = jax.vmap(lambda mb: jnp.sum(weight_fn(**mb)))(micro)  # [k] supervised tokens
        share = n / jnp.maximum(jnp.sum(n), 1.0)
        train, _ = split_trainable(params, trainable)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), train)

        def body(carry: tuple, xs: tuple) -> tuple:
            loss_acc, grad_acc = carry
            j, mb, w = xs
            loss, grads = one(params, mb, None if key is None else jax.random.fold_in(key, j))
            grad_acc = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grad_acc, grads)
            return (loss_acc + w * loss, grad_acc), None

        (loss, grads), _ = jax.lax.scan(
            body, (jnp.zeros((), jnp.float32), zeros), (jnp.arange(k), micro, share)
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train)
        return loss, grads

    def step(
        params: nnx.State, opt_state: Any, batch: Batch, key: jax.Array | None = None
    ) -> tuple[nnx.State, Any, Metrics]:
        loss, grads = (one if accum_steps == 1 else accumulated)(params, batch, key)
        train, rest = split_trainable(params, trainable)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        # fp32 norm whatever the gradient dtype (a bf16 sum of squares loses the metric).
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        return nnx.merge_state(train, rest), opt_state, metrics

    return step


def interleave_microbatches(micro: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """k microbatches of `[b, ...]` arrays → one `[b·k, ...]` batch in the layout of
    `make_train_step(accum_steps=k)` (row `i·k + j` is row i of microbatch j)."""
    k = len(micro)
    out = {}
    for name in micro[0]:
        stacked = np.stack([np.asarray(m[name]) for m in micro], axis=1)  # [b, k, ...]
        out[name] = stacked.reshape(stacked.shape[0] * k, *stacked.shape[2:])
    return out


def jit_train_step(
    step: TrainStep,
    param_shardings: nnx.State,
    opt_shardings: Any,
    batch_sharding: Any,
    mesh: MeshLike,
    strategy: Strategy,
    *,
    fallbacks: Fallbacks | None = None,
    with_key: bool = False,
) -> Any:
    """`jax.jit(step)` with the strategy's shardings: params and optimizer state keep their
    shardings across the step and are donated (updated in place), the batch is split as
    `batch_sharding` says, metrics come back replicated, and the model's activation
    constraints follow the strategy (the resolver is installed while jit traces).

    `batch_sharding` is one sharding for every batch array, or a dict like the batch.
    `with_key`: the step takes a fourth argument, a (replicated) PRNG key for dropout.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    in_shardings = (param_shardings, opt_shardings, batch_sharding)
    return jax.jit(
        with_activation_constraints(step, strategy, mesh, fallbacks=fallbacks),
        in_shardings=(*in_shardings, replicated) if with_key else in_shardings,
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )
