"""Training: pure loss and step functions, and their sharded jit."""

from jaxpi.train.step import (
    init_opt_state,
    jit_train_step,
    loss_and_grads,
    make_train_step,
    next_token_loss,
    split_trainable,
)

__all__ = [
    "init_opt_state",
    "jit_train_step",
    "loss_and_grads",
    "make_train_step",
    "next_token_loss",
    "split_trainable",
]
