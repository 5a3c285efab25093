"""`plan()`: the training step built with abstract arrays only, compiled for the mesh (N virtual
CPU devices), its memory and collectives read from the compiled program beside the analytic model's."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpi import compile_cache
from jaxpi.config import QwenConfig, preset
from jaxpi.convert.quantize import quantize_structure
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.families import model_class
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.plan.analytic import Setup, activation_estimate, collectives_estimate, degree, local_bytes
from jaxpi.plan.flags import MEMORY_SCHEDULER_FLAG, PLANNER_COMPILE_OPTIONS, planner_xla_flags
from jaxpi.plan.request import PlanRequest, PlanResult
from jaxpi.train.step import init_opt_state, jit_train_step, make_train_step, split_trainable
from sharding.hlo import count_collectives
from sharding.mesh import make_mesh, parse_mesh_spec
from sharding.strategies import (
    Fallback,
    batch_sharding,
    get_strategy,
    opt_state_shardings,
    param_shardings,
)


def _build(
    cfg: QwenConfig, dtype: jnp.dtype, lora_rank: int | None, base_quant: str = "none"
) -> Qwen3_5ForCausalLM:
    model = quantize_structure(model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(0)), base_quant)
    if lora_rank:
        add_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    return model


@contextmanager
def _spinner(label: str, enabled: bool) -> Iterator[None]:
    """An elapsed-time line on stderr while a blocking call (XLA compile) runs."""
    stop = threading.Event()

    def run() -> None:
        start = time.perf_counter()
        frames = "|/-\\"
        i = 0
        while not stop.wait(0.5):
            sys.stderr.write(f"\r{frames[i % 4]} {label} {time.perf_counter() - start:5.0f}s")
            sys.stderr.flush()
            i += 1
        sys.stderr.write(f"\r{label} done in {time.perf_counter() - start:.1f}s\n")

    thread = threading.Thread(target=run, daemon=True)
    if enabled and not sys.stderr.isatty():
        sys.stderr.write(f"{label} ...\n")  # no carriage-return animation in logs
        sys.stderr.flush()
        enabled = False
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join()


def plan(req: PlanRequest, *, progress: bool = True) -> PlanResult:
    sizes = parse_mesh_spec(req.mesh)
    n = math.prod(sizes.values())
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(
            f"mesh {req.mesh} needs {n} devices but jax sees {len(devices)}; run the planner through "
            f"`jaxpi plan`, or start Python with XLA_FLAGS='{planner_xla_flags(n)}'"
        )
    dcn = parse_mesh_spec(req.dcn) if req.dcn else None
    mesh = make_mesh(req.mesh, dcn=dcn, devices=devices[:n])
    strategy = get_strategy(req.strategy)
    cfg = preset(req.model).replace(
        remat=req.remat, loss_chunk=req.loss_chunk, attn_impl=req.attn_impl, gdn_impl=req.gdn_impl
    )
    dtype = jnp.dtype(req.dtype)
    trainable = LoRAParam if req.lora_rank else nnx.Param

    abstract = nnx.eval_shape(lambda: _build(cfg, dtype, req.lora_rank, req.base_quant))
    graphdef, state = nnx.split(abstract)
    fallbacks: list[Fallback] = []
    p_shard = param_shardings(state, strategy, mesh, fallbacks=fallbacks)
    # AdamW; first moments in float32 whatever the parameter dtype (full fine-tuning in bf16).
    optimizer = optax.adamw(1e-5, weight_decay=0.0, mu_dtype=jnp.float32)
    opt_abstract = jax.eval_shape(lambda p: init_opt_state(optimizer, p, trainable=trainable), state)
    train_abstract, _ = split_trainable(state, trainable)
    train_shard, _ = split_trainable(p_shard, trainable)
    o_shard = opt_state_shardings(opt_abstract, train_abstract, train_shard, mesh)

    dp = degree(("batch",), strategy, sizes)
    global_batch = req.batch_per_device * dp
    bs = batch_sharding(strategy, mesh, (global_batch, req.seq_len), fallbacks=fallbacks)
    batch = {"input_ids": jax.ShapeDtypeStruct((global_batch, req.seq_len), jnp.int32)}
    step = make_train_step(graphdef, optimizer, trainable=trainable)
    jitted = jit_train_step(step, p_shard, o_shard, {"input_ids": bs}, mesh, strategy, fallbacks=fallbacks)

    compiled_mem: dict[str, int] | None = None
    coll: dict[str, dict[str, int]] | None = None
    seconds = 0.0
    if req.compile:
        compiled_mem, coll, seconds = _compile(jitted, (state, opt_abstract, batch), req, n, progress)
    params_local = local_bytes(state, p_shard)
    train_local = local_bytes(train_abstract, train_shard)
    opt_local = local_bytes(opt_abstract, o_shard)
    setup = Setup(cfg, req, strategy, sizes, state, p_shard)
    analytic = {
        "params": params_local,
        "trainable": train_local,
        "optimizer": opt_local,
        "argument": params_local + opt_local + local_bytes(batch, {"input_ids": bs}),
        "temp": activation_estimate(setup, train_local),
    }
    if compiled_mem is None:
        peak = analytic["argument"] + analytic["temp"]
    else:
        peak = (
            compiled_mem["argument"] + compiled_mem["temp"] + compiled_mem["output"] - compiled_mem["alias"]
        )
    fits = None if req.device_memory is None else peak <= req.device_memory
    return PlanResult(
        request=req,
        devices=n,
        global_batch=global_batch,
        compiled=compiled_mem,
        analytic=analytic,
        collectives=coll,
        collectives_analytic=collectives_estimate(setup, train_abstract, train_shard).to_json(),
        peak_bytes=peak,
        fits=fits,
        fallbacks=sorted({str(f) for f in fallbacks}),
        compile_seconds=seconds,
    )


def _compile(
    jitted: Any, args: tuple[Any, ...], req: PlanRequest, n: int, progress: bool
) -> tuple[dict[str, int], dict[str, dict[str, int]], float]:
    """Compile the step for the mesh: (memory_analysis() per device, collectives, seconds)."""
    if MEMORY_SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", ""):
        warnings.warn(
            f"XLA_FLAGS lacks {MEMORY_SCHEDULER_FLAG}: the compiled temporaries ignore remat "
            "(XLA:CPU's concurrency schedule recomputes during the forward)",
            stacklevel=2,
        )
    label = f"compiling {req.strategy} on {req.mesh} ({n} devices)"
    start = time.perf_counter()
    # compile_cache.disabled(): the figures and the compile time are this compile's, never a load.
    with _spinner(label, progress), compile_cache.disabled():
        compiled = jitted.lower(*args).compile(compiler_options=PLANNER_COMPILE_OPTIONS)
    seconds = time.perf_counter() - start

    mem = compiled.memory_analysis()
    compiled_mem = {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
    }
    coll = count_collectives(compiled.as_text())
    return compiled_mem, coll.to_json(), seconds
