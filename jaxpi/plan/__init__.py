"""Size a sharded training step before renting the pod.

`plan()` builds the training step of a model preset (the real 27B shape included) with abstract
arrays only (`nnx.eval_shape`, `jax.ShapeDtypeStruct`), lowers and compiles it for a mesh of N
devices (on a laptop: N virtual CPU devices), and reports per device:

- parameter, trainable (LoRA) and optimizer-state bytes, from the strategy's shardings;
- argument / temporary / output bytes from `compiled.memory_analysis()`;
- the collectives in the compiled HLO (count and bytes per step, loops unrolled by trip count);

each next to an analytic estimate of the same quantity, and whether it fits the device memory.

Compiling for XLA:CPU stands in for the accelerator's compiler: the SPMD partitioner (which
decides the collectives) is shared, but buffer assignment and fusion are the CPU's. One CPU habit
is switched off in the planner process (see `jaxpi.plan.request.planner_xla_flags`): hoisting per-layer weight
conversions out of the layer loop (while-loop-invariant code motion). One is not: XLA:CPU still
multiplies bf16 in float32 and keeps float32 copies of the operands, which TPU/GPU do not (part of
the one-device gap in docs/sharding.md). Two more settings keep remat's savings, which XLA:CPU
otherwise undoes: common-subexpression elimination is off per compile (`PLANNER_COMPILE_OPTIONS`)
and the memory-minimising schedule is chosen (`MEMORY_SCHEDULER_FLAG`). Differences that remain
are discussed in docs/sharding.md.

Modules: `flags` (the XLA settings), `request` (PlanRequest, PlanResult), `compiled` (`plan`), `analytic`
(the estimates), `table` (`format_table`), `presets` (configs/sharding, the process set-up).
The names below are imported on first use (PEP 562): `jaxpi plan` sets XLA_FLAGS before jax starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

if TYPE_CHECKING:
    from jaxpi.plan.compiled import plan
    from jaxpi.plan.flags import MEMORY_SCHEDULER_FLAG, PLANNER_COMPILE_OPTIONS, planner_xla_flags
    from jaxpi.plan.request import PlanRequest, PlanResult
    from jaxpi.plan.table import format_table

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "plan": "jaxpi.plan.compiled",
    "MEMORY_SCHEDULER_FLAG": "jaxpi.plan.flags",
    "PLANNER_COMPILE_OPTIONS": "jaxpi.plan.flags",
    "planner_xla_flags": "jaxpi.plan.flags",
    "PlanRequest": "jaxpi.plan.request",
    "PlanResult": "jaxpi.plan.request",
    "format_table": "jaxpi.plan.table",
}

__all__ = [
    "MEMORY_SCHEDULER_FLAG",
    "PLANNER_COMPILE_OPTIONS",
    "PlanRequest",
    "PlanResult",
    "format_table",
    "plan",
    "planner_xla_flags",
]


__getattr__, __dir__ = facade(__name__, _WHERE, globals())
