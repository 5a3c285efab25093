"""Training: pure loss and step functions, their sharded jit, the base model (`jaxpi.train.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

if TYPE_CHECKING:
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

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "init_opt_state": "jaxpi.train.step",
    "interleave_microbatches": "jaxpi.train.step",
    "jit_train_step": "jaxpi.train.step",
    "loss_and_grads": "jaxpi.train.step",
    "make_train_step": "jaxpi.train.step",
    "next_token_loss": "jaxpi.train.step",
    "split_trainable": "jaxpi.train.step",
    "target_weights": "jaxpi.train.step",
}

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


__getattr__, __dir__ = facade(__name__, _WHERE, globals())
