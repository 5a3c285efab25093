"""Size a sharded training step before renting the pod.

`plan()` builds the training step of a model preset (the real 27B shape included) with abstract
arrays only (`nnx.eval_shape`, `jax.ShapeDtypeStruct`), lowers and compiles it for a mesh of N
devices (on a laptop: N virtual CPU devices), and reports per device:

- parameter, trainable (LoRA) and optimizer-state bytes, from the strategy's shardings;
- argument / temporary / output bytes from `compiled.memory_analysis()`;
- the collectives in the compiled HLO (count and bytes per step, loops unrolled by trip count);

each next to an analytic estimate of the same quantity, and whether it fits the device memory.

Compiling for XLA:CPU stands in for the accelerator's compiler: the SPMD partitioner (which
decides the collectives) is shared, but buffer assignment and fusion are the CPU's. Two CPU habits
are switched off in the planner process (see `planner_xla_flags`): bf16 matmul "normalisation" to
float32 (TPU/GPU multiply bf16 natively) and hoisting per-layer weight conversions out of the layer
loop. Differences that remain are discussed in docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpi.config import FULL, QwenConfig, preset
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_plan
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

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_per_device < 1:
            raise ValueError("seq_len must be >= 2 and batch_per_device >= 1")
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
    cfg = preset(req.model).replace(remat=req.remat)
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

    label = f"compiling {req.strategy} on {req.mesh} ({n} devices)"
    start = time.perf_counter()
    with _spinner(label, progress):
        compiled = jitted.lower(state, opt_abstract, batch).compile()
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


def _activation_estimate(setup: _Setup, train_local: int) -> int:
    """Temporary bytes per device for one step with remat per layer group.

    live = the residual stream saved at every group boundary
         + one group's recomputed forward intermediates during its backward
         + float32 logits and their gradient (the loss over the full vocabulary)
         + the gradients of the trainable weights
         + one group's parameters gathered (when the strategy shards them)
    """
    cfg, req, strategy, sizes, state, p_shard = (
        setup.cfg,
        setup.req,
        setup.strategy,
        setup.sizes,
        setup.state,
        setup.p_shard,
    )
    b = req.batch_per_device * _degree(("batch",), strategy, sizes)
    t, d, act = req.seq_len, cfg.hidden_size, jnp.dtype(req.dtype).itemsize
    loc = lambda axes, shape: _local(strategy, sizes, axes, shape)  # noqa: E731
    p, g = layer_plan(cfg)
    resid = loc(("batch", "seq", "embed"), (b, t, d)) * act
    saved = resid * (g + len(cfg.layer_types) - p * g)
    per_type = {
        FULL: (
            2 * loc(("batch", "seq", "embed"), (b, t, d))
            + 2
            * loc(("batch", "seq", "q_heads", "head_dim"), (b, t, cfg.num_attention_heads, 2 * cfg.head_dim))
            + 2 * loc(("batch", "seq", "kv_heads", "head_dim"), (b, t, cfg.num_key_value_heads, cfg.head_dim))
        )
        * act
        # scores and probabilities [B, Hq, T, T] in float32 (attention is not flash-tiled yet)
        + 2 * loc(("batch", "q_heads", "seq", None), (b, cfg.num_attention_heads, t, t)) * 4,
        "linear_attention": (
            2 * loc(("batch", "seq", "embed"), (b, t, d))
            + 2
            * loc(
                ("batch", "seq", "gdn_k_heads", "head_dim"),
                (b, t, 2 * cfg.linear_num_key_heads, cfg.linear_key_head_dim),
            )
            + 4
            * loc(
                ("batch", "seq", "gdn_v_heads", "head_dim"),
                (b, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim),
            )
        )
        * act
        # the chunked delta rule keeps float32 [B, Hv, T, C] within-chunk matrices and per-chunk states
        + 3
        * loc(("batch", "gdn_v_heads", "seq", None), (b, cfg.linear_num_value_heads, t, cfg.gdn_chunk_size))
        * 4
        + loc(
            ("batch", "gdn_v_heads", None, None),
            (
                b,
                cfg.linear_num_value_heads,
                t // cfg.gdn_chunk_size + 1,
                cfg.linear_key_head_dim * cfg.linear_value_head_dim,
            ),
        )
        * 4,
    }
    mlp = 3 * loc(("batch", "seq", "mlp"), (b, t, cfg.intermediate_size)) * act
    group_types = cfg.layer_types[:p] if g else cfg.layer_types
    group_live = sum(per_type[ty] + mlp for ty in group_types)
    logits = 2 * loc(("batch", "seq", "vocab"), (b, t, cfg.vocab_size)) * 4
    full, local = _group_param_bytes(state, p_shard)
    gathered = 2 * (full - local)
    return int(saved + group_live + logits + train_local + gathered)


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
        + (f"  LoRA rank {r0.lora_rank}" if r0.lora_rank else "  full fine-tuning"),
    )
    notes = sorted({f for r in results for f in r.fallbacks})
    if notes:
        lines.append(
            "not divisible, kept replicated: " + "; ".join(notes[:6]) + (" ..." if len(notes) > 6 else "")
        )
    return "\n".join(lines)
