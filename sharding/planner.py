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
is switched off in the planner process (see `planner_xla_flags`): hoisting per-layer weight
conversions out of the layer loop (while-loop-invariant code motion). One is not: XLA:CPU still
multiplies bf16 in float32 and keeps float32 copies of the operands, which TPU/GPU do not (part of
the one-device gap in docs/sharding.md). Two more settings keep remat's savings, which XLA:CPU
otherwise undoes: common-subexpression elimination is off per compile (`PLANNER_COMPILE_OPTIONS`)
and the memory-minimising schedule is chosen (`MEMORY_SCHEDULER_FLAG`). Differences that remain
are discussed in docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
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
import numpy as np
import optax
from flax import nnx

from jaxpi import compile_cache
from jaxpi.config import ATTN_IMPLS, FULL, GDN_IMPLS, LINEAR, REMAT_POLICIES, QwenConfig, preset
from jaxpi.kernels.attention import ATTN_BLOCK
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import UNROLL_GROUPS, Qwen3_5ForCausalLM, layer_plan
from jaxpi.train.step import init_opt_state, jit_train_step, make_train_step, split_trainable
from sharding.hlo import KINDS, Collectives, count_collectives
from sharding.mesh import make_mesh, parse_mesh_spec
from sharding.strategies import (
    Fallback,
    Strategy,
    batch_sharding,
    get_strategy,
    opt_state_shardings,
    param_shardings,
    spec_for,
)

GiB = 1024**3


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
    """XLA_FLAGS for a planning process (set before jax initialises its backend)."""
    from jaxpi.cli import _plan_flags

    return _plan_flags(num_devices)


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    model: str = "qwen3_5_27b"
    mesh: str = "fsdp=8"
    strategy: str = "fsdp"
    seq_len: int = 8192
    batch_per_device: int = 1
    lora_rank: int | None = None
    device_memory: int | None = None  # bytes
    dtype: str = "bfloat16"
    remat: str = "full"
    dcn: str | None = None
    loss_chunk: int = 0  # the LM head this many positions at a time (0: all at once)
    attn_impl: str = "jax"  # QwenConfig.attn_impl: "jax" (blocked, scores kept) | "pallas" (flash)
    gdn_impl: str = "jax"  # QwenConfig.gdn_impl (one of GDN_IMPLS)

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_per_device < 1:
            raise ValueError("seq_len must be >= 2 and batch_per_device >= 1")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 (0: the LM head at once), got {self.loss_chunk}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {self.remat!r} is not one of {REMAT_POLICIES}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {self.attn_impl!r} is not one of {ATTN_IMPLS}")
        if self.gdn_impl not in GDN_IMPLS:
            raise ValueError(f"gdn_impl {self.gdn_impl!r} is not one of {GDN_IMPLS}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError("lora_rank must be >= 1")
        parse_mesh_spec(self.mesh)
        get_strategy(self.strategy)


@dataclasses.dataclass
class PlanResult:
    request: PlanRequest
    devices: int
    global_batch: int
    compiled: dict[str, int]  # per device, from memory_analysis()
    analytic: dict[str, int]  # per device, from shapes and shardings
    collectives: dict[str, dict[str, int]]
    collectives_analytic: dict[str, dict[str, int]]
    peak_bytes: int
    fits: bool | None
    fallbacks: list[str]
    compile_seconds: float

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request"] = dataclasses.asdict(self.request)
        return out


# ---- model, state and step (abstract) ---------------------------------------------------------------
def _build(cfg: QwenConfig, dtype: jnp.dtype, lora_rank: int | None) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    if lora_rank:
        add_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    return model


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _local_bytes(tree: Any, shardings: Any) -> int:
    """Bytes of one device's shards of `tree` laid out as `shardings`."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        local = s.shard_shape(tuple(x.shape))
        total += int(np.prod(local)) * jnp.dtype(x.dtype).itemsize
    return total


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

    abstract = nnx.eval_shape(lambda: _build(cfg, dtype, req.lora_rank))
    graphdef, state = nnx.split(abstract)
    fallbacks: list[Fallback] = []
    p_shard = param_shardings(state, strategy, mesh, fallbacks=fallbacks)
    # AdamW; first moments in float32 whatever the parameter dtype (full fine-tuning in bf16).
    optimizer = optax.adamw(1e-5, weight_decay=0.0, mu_dtype=jnp.float32)
    opt_abstract = jax.eval_shape(lambda p: init_opt_state(optimizer, p, trainable=trainable), state)
    train_abstract, _ = split_trainable(state, trainable)
    train_shard, _ = split_trainable(p_shard, trainable)
    o_shard = opt_state_shardings(opt_abstract, train_abstract, train_shard, mesh)

    dp = _degree(("batch",), strategy, sizes)
    global_batch = req.batch_per_device * dp
    bs = batch_sharding(strategy, mesh, (global_batch, req.seq_len), fallbacks=fallbacks)
    batch = {"input_ids": jax.ShapeDtypeStruct((global_batch, req.seq_len), jnp.int32)}
    step = make_train_step(graphdef, optimizer, trainable=trainable)
    jitted = jit_train_step(step, p_shard, o_shard, {"input_ids": bs}, mesh, strategy, fallbacks=fallbacks)

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
        compiled = jitted.lower(state, opt_abstract, batch).compile(compiler_options=PLANNER_COMPILE_OPTIONS)
    seconds = time.perf_counter() - start

    mem = compiled.memory_analysis()
    compiled_mem = {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
    }
    peak = compiled_mem["argument"] + compiled_mem["temp"] + compiled_mem["output"] - compiled_mem["alias"]
    params_local = _local_bytes(state, p_shard)
    train_local = _local_bytes(train_abstract, train_shard)
    opt_local = _local_bytes(opt_abstract, o_shard)
    setup = _Setup(cfg, req, strategy, sizes, state, p_shard)
    analytic = {
        "params": params_local,
        "trainable": train_local,
        "optimizer": opt_local,
        "argument": params_local + opt_local + _local_bytes(batch, {"input_ids": bs}),
        "temp": _activation_estimate(setup, train_local),
    }
    coll = count_collectives(compiled.as_text())
    fits = None if req.device_memory is None else peak <= req.device_memory
    return PlanResult(
        request=req,
        devices=n,
        global_batch=global_batch,
        compiled=compiled_mem,
        analytic=analytic,
        collectives=coll.to_json(),
        collectives_analytic=_collectives_estimate(setup, train_abstract, train_shard).to_json(),
        peak_bytes=peak,
        fits=fits,
        fallbacks=sorted({str(f) for f in fallbacks}),
        compile_seconds=seconds,
    )


# ---- analytic estimates ---------------------------------------------------------------------------
def _degree(logical: tuple[str, ...], strategy: Strategy, sizes: dict[str, int]) -> int:
    """How many ways the activation axes `logical` are split (e.g. the data-parallel degree)."""
    axes: set[str] = set()
    for name in logical:
        value = strategy.activations.get(name)
        axes |= {value} if isinstance(value, str) else set(value or ())
    return math.prod(sizes.get(a, 1) for a in axes)


def _local(strategy: Strategy, sizes: dict[str, int], axes: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """Elements of one device's shard of an activation with these logical axes."""
    spec = spec_for(axes, shape, strategy.activations, sizes)
    n = 1
    for dim, entry in zip(shape, spec, strict=False):
        parts = (entry,) if isinstance(entry, str) else (entry or ())
        n *= dim // math.prod(sizes.get(a, 1) for a in parts)
    return n * math.prod(shape[len(spec) :])


def _axes_of(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _group_param_bytes(state: nnx.State, shardings: nnx.State) -> tuple[int, int]:
    """(full, local) bytes of ONE layer group's parameters (the stacked `groups` subtree / G)."""
    if "groups" not in state:
        return 0, 0
    g = jax.tree.leaves(state["groups"])[0].shape[0]
    full = _nbytes(state["groups"]) // g
    local = _local_bytes(state["groups"], shardings["groups"]) // g
    return full, local


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What both analytic estimates read: the request, its model and strategy, the mesh sizes and
    the abstract parameter state with its shardings."""

    cfg: QwenConfig
    req: PlanRequest
    strategy: Strategy
    sizes: dict[str, int]
    state: Any
    p_shard: Any


@dataclasses.dataclass(frozen=True)
class _LayerBytes:
    """Bytes per device of one layer's forward intermediates, by what the remat policies keep.

    `total` is what autodiff keeps for the layer's backward without remat; `proj` the outputs of
    its weight projections (dot_generals without batch dimensions, the subset `dots_no_batch`
    saves), of which `mlp_gate_up` are the MLP's gate and up outputs (the "mlp" policy's names);
    `batched` the outputs of its batched dot_generals (attention scores and block outputs, the
    delta rule's chunk products and states), which `dots` saves on top of `proj`.
    """

    total: int
    proj: int
    mlp_gate_up: int
    batched: int
    out: int  # the layer's output [B, T, D] (the "mlp_out" policy's third name)

    def kept(self, remat: str) -> int:
        """Bytes the policy saves in the forward for this layer's backward (the rest is recomputed)."""
        return {
            "none": self.total,
            "full": 0,
            "mlp": self.mlp_gate_up,
            "mlp_out": self.mlp_gate_up + self.out,
            "dots_no_batch": self.proj,
            "dots": self.proj + self.batched,
        }[remat]


def _attention_block_elems(t: int, block: int) -> int:
    """Score elements per (batch row, head) of `causal_attention`: block i holds [hi - lo, hi].

    Σ over blocks of (hi - lo) · hi ≈ T · (T + c) / 2: the blocks skip the masked upper triangle,
    but autodiff keeps every block's probabilities for the backward, so it is about half the
    dense [T, T], not one block's worth (a flash kernel would keep only [T] statistics).
    """
    c = min(block, t)
    return sum((min(lo + c, t) - lo) * min(lo + c, t) for lo in range(0, t, c))


def _layer_bytes(setup: _Setup, b: int) -> dict[str, _LayerBytes]:
    """`_LayerBytes` of each layer type, MLP included, for `b` rows of `seq_len` tokens."""
    cfg, req = setup.cfg, setup.req
    t, d, f, act = req.seq_len, cfg.hidden_size, cfg.intermediate_size, jnp.dtype(req.dtype).itemsize
    loc = lambda axes, shape: _local(setup.strategy, setup.sizes, axes, shape)  # noqa: E731
    resid = loc(("batch", "seq", "embed"), (b, t, d))
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )

    # MLP: gate and up [B, T, F] (the projections "mlp" keeps), silu(gate)·up, down [B, T, D];
    # its input (the post-norm residual) and that input normalised.
    gate_up = 2 * loc(("batch", "seq", "mlp"), (b, t, f)) * act
    mlp_proj = gate_up + resid * act
    mlp_total = gate_up + loc(("batch", "seq", "mlp"), (b, t, f)) * act + 2 * resid * act

    # Gated attention: q|gate [B, T, Hq, 2d], k and v [B, T, Hkv, d], o_proj [B, T, D] projected;
    # q, k normed and rotated; per score element of each query block the float32 softmax output
    # and the probabilities in the activation dtype; block outputs [B, T, Hq, d] and their gated
    # copy; the layer input and its norm.
    q = loc(("batch", "seq", "q_heads", "head_dim"), (b, t, hq, hd))
    kv = loc(("batch", "seq", "kv_heads", "head_dim"), (b, t, hkv, hd))
    attn_proj = (2 * q + 2 * kv + resid) * act
    if cfg.attn_impl == "pallas":
        # Flash attention keeps no scores: the kernel saves the softmax's log-sum-exp [B, Hq, T]
        # in float32, and its inputs include k and v repeated to the query heads (GQA).
        core = loc(("batch", "q_heads", "seq"), (b, hq, t)) * 4 + (2 * q * act if hkv < hq else 0)
        attn_batched = 0  # a kernel call, not a dot: `dots` saves none of it
    else:
        scores = loc(("batch", "q_heads", None), (b, hq, _attention_block_elems(t, ATTN_BLOCK)))
        core = scores * (4 + act)
        # `dots` saves the float32 scores of every block (a batched dot) and the block outputs.
        attn_batched = scores * 4 + q * act
    attn_total = attn_proj + (2 * q + kv + 2 * resid) * act + core

    # Gated DeltaNet: q, k [B, T, Hk, dk], v, z [B, T, Hv, dv], a, b [B, T, Hv] and out_proj
    # projected; the conv outputs and normalised q, k; the chunked delta rule's float32 products
    # (k·kᵀ, its inverse, q·kᵀ: [B, Hv, T, C] each; u, w, delta, out: [B, Hv, T, dk|dv]) and the
    # per-chunk states [B, Hv, T/C + 1, dk·dv]; the core output and its gated norm.
    qk = loc(("batch", "seq", "gdn_k_heads", "head_dim"), (b, t, 2 * hk, dk))
    vz = loc(("batch", "seq", "gdn_v_heads", "head_dim"), (b, t, 2 * hv, dv))
    ab = loc(("batch", "seq", "gdn_v_heads"), (b, t, 2 * hv))
    chunk = cfg.gdn_chunk_size
    per_chunk = loc(("batch", "gdn_v_heads", "seq", None), (b, hv, t, 3 * chunk + dk + 3 * dv))
    states = loc(("batch", "gdn_v_heads", None, None), (b, hv, t // chunk + 1, dk * dv))
    gdn_batched = (per_chunk + states) * 4
    gdn_proj = (qk + vz + ab + resid) * act
    gdn_total = gdn_proj + (qk + vz + 2 * resid) * act + gdn_batched

    return {
        FULL: _LayerBytes(attn_total + mlp_total, attn_proj + mlp_proj, gate_up, attn_batched, resid * act),
        LINEAR: _LayerBytes(gdn_total + mlp_total, gdn_proj + mlp_proj, gate_up, gdn_batched, resid * act),
    }


def _logits_bytes(setup: _Setup, b: int) -> int:
    """The LM head's live logits: float32 logits and their gradient for `loss_chunk` positions at
    a time (all T when 0), plus the activation-dtype logits they are upcast from."""
    cfg, req = setup.cfg, setup.req
    t = req.seq_len if not 0 < req.loss_chunk < req.seq_len else req.loss_chunk
    elems = _local(setup.strategy, setup.sizes, ("batch", "seq", "vocab"), (b, t, cfg.vocab_size))
    act = jnp.dtype(req.dtype).itemsize
    return elems * (2 * 4 + (act if act < 4 else 0))


def _temp_terms(setup: _Setup, train_local: int) -> dict[str, int]:
    """The terms of the temporary bytes per device of one step, under the request's remat policy
    and loss chunk. Live throughout the backward:

      saved           what the forward saves across the whole stack for the backward;
      trainable_grads the gradients of the trainable weights;

    and, one after the other (the peak takes the larger):

      loss_phase      the LM head's float32 logits and their gradient (`loss_chunk` positions
                      of them when set), plus the last unit's backward when that runs beside it;
      layer_phase     one remat unit's backward: its recomputed intermediates, one layer's
                      gradients (taken as the size of its intermediates) and the unit's weights
                      gathered (when the strategy shards them).

    A remat unit is a scanned layer group (jax.checkpoint wraps the group body) or one tail
    layer. What each policy saves across the stack, per layer (`_LayerBytes`):
      none          every intermediate of every layer; nothing recomputed;
      full          the residual stream at each unit boundary only;
      mlp           the boundaries + every layer's MLP gate and up outputs [B, T, F];
      mlp_out       those + every layer's output [B, T, D];
      dots_no_batch the boundaries + every weight projection's output;
      dots          those + every batched dot: float32 attention scores of every query block
                    and the delta rule's chunk products. The dots policies are the roughest:
                    which dot_generals XLA keeps, and which elementwise results it fuses into
                    them, is decided by the compiler.
    Attention is blocked (`causal_attention`): per layer about T·(T + c)/2 score elements per head
    live for the backward, in float32 plus the activation dtype; with `attn_impl="pallas"` (flash)
    only a float32 log-sum-exp per query and head, and k, v repeated to the query heads. Every
    `gdn_impl` is counted as the plain chunk scan (the split and Pallas scans also save the states
    entering the chunks; how their other residuals differ is not modelled).
    """
    req, strategy, sizes = setup.req, setup.strategy, setup.sizes
    cfg = setup.cfg
    b = req.batch_per_device * _degree(("batch",), strategy, sizes)
    act = jnp.dtype(req.dtype).itemsize
    resid = _local(strategy, sizes, ("batch", "seq", "embed"), (b, req.seq_len, cfg.hidden_size)) * act
    layers = _layer_bytes(setup, b)
    p, g = layer_plan(cfg)
    units = ([cfg.layer_types[:p]] if g else []) + [(ty,) for ty in cfg.layer_types[p * g :]]
    n_units = g + len(cfg.layer_types) - p * g
    saved = sum(layers[ty].kept(req.remat) for ty in cfg.layer_types)
    if req.remat != "none":
        saved += resid * n_units  # each unit's input, what the recomputation starts from
    full, local = _group_param_bytes(setup.state, setup.p_shard)
    gathered = 2 * (full - local)
    grads = max(layers[ty].total for ty in set(cfg.layer_types))

    def backward(unit: tuple[str, ...]) -> int:
        """One unit's backward: its recomputed intermediates, one layer's gradients, its weights."""
        return sum(layers[ty].total - layers[ty].kept(req.remat) for ty in unit) + grads + gathered

    # Outside the layer loop (a tail layer, or a stack of at most UNROLL_GROUPS groups, unrolled)
    # the last unit's recomputation and backward may run beside the loss's backward: XLA schedules
    # them together (tiny, 4 tail layers: chunking the loss lowers the compiled temp by 0.6 of the
    # logits term). Inside the loop they come after it (27B: chunking leaves the temp unchanged).
    in_loop = p * g == len(cfg.layer_types) and g > UNROLL_GROUPS
    logits = _logits_bytes(setup, b)
    return {
        "saved": saved,
        "trainable_grads": train_local,
        "loss_phase": logits + (0 if in_loop else backward(units[-1])),
        "layer_phase": max(backward(u) for u in units),
    }


def _activation_estimate(setup: _Setup, train_local: int) -> int:
    """Temporary bytes per device: the saved stack and the trainable gradients, plus the larger of
    the backward's two phases (see `_temp_terms`)."""
    t = _temp_terms(setup, train_local)
    return int(t["saved"] + t["trainable_grads"] + max(t["loss_phase"], t["layer_phase"]))


def _collectives_estimate(setup: _Setup, train: Any, train_shard: Any) -> Collectives:
    """What the strategy implies per step (result bytes per device, as `count_collectives`).

    - weights split over a batch axis (FSDP) are all-gathered once in the forward and once more
      for the backward (the remat recomputation reuses the backward's gather);
    - gradients of such weights are reduce-scattered; of weights replicated over the batch axes
      (DP, or TP shards) all-reduced over the data-parallel devices;
    - tensor parallelism all-reduces the residual-stream contribution of every mixer and MLP:
      forward, remat recompute and backward (for the input gradient).
    """
    cfg, req, strategy, sizes, state, p_shard = (
        setup.cfg,
        setup.req,
        setup.strategy,
        setup.sizes,
        setup.state,
        setup.p_shard,
    )
    out = Collectives()
    groups, n_layers = layer_plan(cfg)[1], len(cfg.layer_types)
    batch_axes = {a for a in _axes_of(strategy.activations.get("batch")) if sizes.get(a, 1) > 1}

    def fsdp_factor(x: Any, s: Any) -> int:
        """How many ways the weight is split over axes that also split the batch (gathered)."""
        used = {a for entry in s.spec for a in _axes_of(entry)}
        return math.prod(sizes[a] for a in used & batch_axes)

    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(p_shard), strict=True):
        k = fsdp_factor(x, s)
        if k > 1:
            local = int(np.prod(s.shard_shape(tuple(x.shape)))) * jnp.dtype(x.dtype).itemsize
            # A stacked [G, ...] weight is gathered one group slice per loop iteration: G collectives.
            stacked = groups if groups and x.ndim and x.shape[0] == groups else 1
            out.count["all-gather"] += 2 * stacked
            out.bytes["all-gather"] += 2 * local * k
    dp = _degree(("batch",), strategy, sizes)
    if dp > 1:
        for x, s in zip(jax.tree.leaves(train), jax.tree.leaves(train_shard), strict=True):
            local = int(np.prod(s.shard_shape(tuple(x.shape)))) * jnp.dtype(x.dtype).itemsize
            if fsdp_factor(x, s) > 1:  # reduced and scattered back onto the weight's shards
                out.count["reduce-scatter"] += 1
                out.bytes["reduce-scatter"] += local
            else:  # replicated over the batch axes: every replica needs the sum
                out.count["all-reduce"] += 1
                out.bytes["all-reduce"] += local
    tp = sizes.get("tensor", 1) if strategy.params.get("mlp") else 1
    if tp > 1:
        b = req.batch_per_device * dp
        resid = _local(strategy, sizes, ("batch", "seq", "embed"), (b, req.seq_len, cfg.hidden_size))
        out.count["all-reduce"] += 3 * 2 * n_layers
        out.bytes["all-reduce"] += 3 * 2 * n_layers * resid * jnp.dtype(req.dtype).itemsize
    return out


# ---- report ---------------------------------------------------------------------------------------
def _gib(x: int | None) -> str:
    """Bytes for a table cell: GiB with two decimals, or MiB/KiB when that would read 0.00."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= 0.01 * scale or unit == "KiB":
            return f"{x / scale:.2f} {unit}"
    return f"{x} B"


def format_table(results: list[PlanResult]) -> str:
    """One column per plan: memory per device (compiled vs analytic) and collectives per step."""
    head = ["", *[f"{r.request.strategy} [{r.request.mesh}]" for r in results]]
    rows: list[list[str]] = []

    def row(name: str, values: list[str]) -> None:
        rows.append([name, *values])

    row("devices / global batch", [f"{r.devices} / {r.global_batch}" for r in results])
    row("params /dev", [_gib(r.analytic["params"]) for r in results])
    row("trainable /dev", [_gib(r.analytic["trainable"]) for r in results])
    row("optimizer /dev", [_gib(r.analytic["optimizer"]) for r in results])
    row(
        "arguments /dev (compiled | analytic)",
        [f"{_gib(r.compiled['argument'])} | {_gib(r.analytic['argument'])}" for r in results],
    )
    row(
        "temp /dev (compiled | analytic)",
        [f"{_gib(r.compiled['temp'])} | {_gib(r.analytic['temp'])}" for r in results],
    )
    row("peak /dev (compiled)", [_gib(r.peak_bytes) for r in results])
    row("fits device memory", ["-" if r.fits is None else ("yes" if r.fits else "NO") for r in results])
    for k in KINDS:
        row(
            f"{k} n, bytes/dev (compiled | analytic)",
            [
                f"{r.collectives[k]['count']}, {_gib(r.collectives[k]['bytes'])} | "
                f"{r.collectives_analytic[k]['count']}, {_gib(r.collectives_analytic[k]['bytes'])}"
                for r in results
            ],
        )
    row("compile s", [f"{r.compile_seconds:.0f}" for r in results])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    r0 = results[0].request
    lines.insert(
        0,
        f"{r0.model}  seq {r0.seq_len}  batch/device {r0.batch_per_device}  dtype {r0.dtype}  remat {r0.remat}"
        + (f"  loss_chunk {r0.loss_chunk}" if r0.loss_chunk else "")
        + (f"  attn_impl {r0.attn_impl}" if r0.attn_impl != "jax" else "")
        + (f"  gdn_impl {r0.gdn_impl}" if r0.gdn_impl != "jax" else "")
        + (f"  LoRA rank {r0.lora_rank}" if r0.lora_rank else "  full fine-tuning"),
    )
    notes = sorted({f for r in results for f in r.fallbacks})
    if notes:
        lines.append(
            "not divisible, kept replicated: " + "; ".join(notes[:6]) + (" ..." if len(notes) > 6 else "")
        )
    return "\n".join(lines)
