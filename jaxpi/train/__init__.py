"""Training: pure loss and step functions, their sharded jit, the LoRA SFT trainer (`jaxpi.train.sft`)."""

from jaxpi.train.step import (
    init_opt_state,
    interleave_microbatches,
    jit_train_step,
    loss_and_grads,
    make_train_step,
    next_token_loss,
    split_trainable,
    target_weights,
)

__all__ = [
    "init_opt_state",
    "interleave_microbatches",
    "jit_train_step",
    "loss_and_grads",
    "make_train_step",
    "next_token_loss",
    "split_trainable",
    "target_weights",
]
