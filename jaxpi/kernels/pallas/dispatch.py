"""Which lowering of a Pallas kernel runs: chosen per platform at lowering time, or forced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def per_platform(build: Callable[[str], Callable], interpret: bool | str | None, *args: jax.Array) -> Any:
    """build(mode)(*args) for mode "interpret", "triton", "mosaic" or "mosaic_interpret".

    `interpret`: None picks by platform when lowering (Triton on GPU, Mosaic on TPU, Pallas'
    interpreter on CPU); True forces the generic interpreter, "tpu" the TPU interpreter; False
    compiles for the device and has no CPU branch.
    """
    if interpret is True:
        return build("interpret")(*args)
    if interpret == "tpu":
        return build("mosaic_interpret")(*args)
    branches = {"cuda": build("triton"), "rocm": build("triton"), "tpu": build("mosaic")}
    if interpret is None:
        branches["cpu"] = build("interpret")
    return jax.lax.platform_dependent(*args, **branches)
