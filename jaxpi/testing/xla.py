"""The XLA flags of the test suite (tests/conftest.py) and of the processes its tests start.

The suite compiles hundreds of small programs and runs each for milliseconds, so the CPU backend's
LLVM optimisation level is 0: measured on the 2-core CI machine, tests/test_scan_loop.py and
tests/test_lora_merge.py took 122 CPU-s at XLA's default level and 63 at 0 (2026-12-03, compile
cache off). The operations are the same IEEE float32 ones (no fast-math at any level); the
rounding of fused elementwise code differs: a 5-layer tiny model's LoRA gradients moved by at most
7.8e-7 between the two levels. A run of `make test` with `XLA_FLAGS` set in the environment keeps
those flags instead (e.g. `XLA_FLAGS=--xla_force_host_platform_device_count=8 make test`, XLA's
defaults).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

FAST_COMPILE = "--xla_backend_optimization_level=0"
SUITE = f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"


def child_env(
    env: Mapping[str, str] | None = None, *, devices: int | None = None, fast_compile: bool = True
) -> dict[str, str]:
    """`env` (default os.environ) for a child process: the suite's compile level, and `devices`
    virtual CPU devices (None: one, as a user's CPU run), whatever device count `env` held.
    `fast_compile=False`: XLA's default level, for children that run their programs for long
    (a GRPO run decodes thousands of tokens: level 0's unvectorised code made tests/test_study.py
    take 308 s against 259 at the default, measured in one `make test` each, 2026-12-03)."""
    out = dict(os.environ if env is None else env)
    if not fast_compile or (
        os.environ.get("XLA_FLAGS", SUITE) != SUITE and FAST_COMPILE not in os.environ.get("XLA_FLAGS", "")
    ):
        fast = ""  # the suite runs under the caller's own XLA_FLAGS: their compile level too
    else:
        fast = FAST_COMPILE
    count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    flags = f"{count} {fast}".strip()
    if flags:
        out["XLA_FLAGS"] = flags
    else:
        out.pop("XLA_FLAGS", None)
    return out
