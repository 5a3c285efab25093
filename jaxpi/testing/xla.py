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

DEVICE_COUNT = "--xla_force_host_platform_device_count"
LEVEL = "--xla_backend_optimization_level"
FAST_COMPILE = f"{LEVEL}=0"
SUITE = f"{DEVICE_COUNT}=8 {FAST_COMPILE}"


def child_env(
    env: Mapping[str, str] | None = None, *, devices: int | None = None, fast_compile: bool = True
) -> dict[str, str]:
    """`env` (default os.environ) for a child process: its XLA_FLAGS with the device count
    replaced by `devices` virtual CPU devices (None: one, as a user's CPU run); every other flag
    (the suite's compile level, or whatever the caller's XLA_FLAGS held) is kept.
    `fast_compile=False` also drops the compile level, for children that run their programs for
    long (a GRPO run decodes thousands of tokens: level 0's unvectorised code made
    tests/test_study.py take 308 s against 259 at the default, one `make test` each, 2026-12-03)."""
    out = dict(os.environ if env is None else env)
    flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    if not fast_compile:
        flags = [f for f in flags if not f.startswith(LEVEL)]
    if devices:
        flags.insert(0, f"{DEVICE_COUNT}={devices}")
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    else:
        out.pop("XLA_FLAGS", None)
    return out
