"""Known-bad backward passes, swapped in at trace time to prove the parity harness catches them.

Each bug keeps the forward exactly (the loss does not move) and corrupts some gradients, the
class of bug the seed report found in a fused RMSNorm kernel and public reports found in Gated
DeltaNet kernels. `inject_bug(name)` activates one for the functions traced inside it; the
kernels ask `active()` and, for the DeltaNet bugs, route through `backward_of`, whose forward is
the correct function and whose backward is the vector-Jacobian product of the buggy one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

NORM_BUGS: dict[str, str] = {
    "rmsnorm-dx-no-offset": "RMSNorm dX uses w instead of (1 + w)",
    "rmsnorm-dx-double-weight": "RMSNorm dX applies the weight twice in its variance term",
    "gated-norm-pre-gate": "gated RMSNorm dX and dW are taken from the recomputed pre-gate output (no silu(z))",
}
DELTANET_BUGS: dict[str, str] = {
    # fla-org/flash-linear-attention#1140: short sequences in a varlen batch
    "conv-short-chunk-dw": "the short conv's weight gradient looks back one block of K-2 tokens only, "
    "dropping the taps that reach further (chunks shorter than the window minus one)",
    # FlashQLA#28: A_log / dt_bias gradients corrupted under strong decay
    "gate-grad-pre-exp": "the within-chunk decay gradient is taken from the pre-exp sum "
    "Σ g instead of its exponential",
    "l2norm-no-inv-norm": "the q/k L2-norm backward misses its 1/‖x‖ factor",
    "segment-reset-off-by-one": "the DeltaNet backward resets its state one token after each "
    "packed segment starts (only packed sequences show it)",
}
KNOWN_BUGS: dict[str, str] = {**NORM_BUGS, **DELTANET_BUGS}
_active: str | None = None


@contextlib.contextmanager
def inject_bug(name: str | None) -> Iterator[None]:
    """Trace the kernels with a known-bad backward inside this context (`None` = correct kernels).

    The choice is read at trace time: functions jitted outside the context keep their kernels.
    """
    global _active
    if name is not None and name not in KNOWN_BUGS:
        raise ValueError(f"unknown bug {name!r}; known: {sorted(KNOWN_BUGS)}")
    previous, _active = _active, name
    try:
        yield
    finally:
        _active = previous


def active() -> str | None:
    """The bug being injected into the functions traced now, if any."""
    return _active


def backward_of(correct: Callable[..., Any], buggy: Callable[..., Any]) -> Callable[..., Any]:
    """`correct`'s values with `buggy`'s vector-Jacobian product (both take the same arguments)."""

    @jax.custom_vjp
    def fn(*args: Any) -> Any:
        return correct(*args)

    def fwd(*args: Any) -> tuple[Any, tuple]:
        return correct(*args), args

    def bwd(args: tuple, cotangent: Any) -> tuple:
        return jax.vjp(buggy, *args)[1](cotangent)

    fn.defvjp(fwd, bwd)
    return fn
