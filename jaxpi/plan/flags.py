"""The XLA settings a planning process compiles under (no jax here: `jaxpi plan` sets XLA_FLAGS
from these before jax starts its backend)."""

from __future__ import annotations

# Per compile: no common-subexpression elimination. XLA:CPU drops remat's optimisation barriers
# before its CSE runs, which then merges the backward's recomputation back into the forward it
# repeats: every remat policy compiled like "none" (a remat'd 8-layer toy: 119 dots lowered, 95
# compiled, as many as without remat). The loop-invariant motion stays off as in
# `planner_xla_flags` (this list replaces that one). The two LLVM settings only shorten machine
# code generation, which the memory figures do not depend on (tiny: same temp bytes, compile
# time halved).
PLANNER_COMPILE_OPTIONS = {
    "xla_disable_hlo_passes": "cse,while-loop-invariant-code-motion",
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


# XLA:CPU's default schedule is built for concurrency (breadth first): it runs each remat unit's
# recomputation as soon as its inputs exist, during the forward, so every layer's recomputed
# intermediates are live at once and remat saves nothing. The depth-first, memory-minimising
# schedule is the one that stands in for an accelerator's memory-aware scheduler. XLA:CPU reads
# this choice from XLA_FLAGS only (as a compile option it is accepted and ignored).
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def planner_xla_flags(num_devices: int) -> str:
    """XLA_FLAGS for a planning process (set before jax initialises its backend): the device count,
    no loop-invariant code motion, and the memory-minimising schedule (XLA:CPU reads its scheduler
    choice from XLA_FLAGS only)."""
    return (
        f"--xla_force_host_platform_device_count={num_devices} "
        f"--xla_disable_hlo_passes=while-loop-invariant-code-motion {MEMORY_SCHEDULER_FLAG}"
    )
