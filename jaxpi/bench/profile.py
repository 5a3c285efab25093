"""Where the train step's time goes: a `jax.profiler` trace of the compiled step, op by op.

The trace's per-op events (XLA CPU thunks / GPU kernels, named after HLO instructions) are
matched to the optimized HLO's `metadata={op_name=...}`, which carries the `jax.named_scope`s of
the model (`mixer/delta_rule/ut_transform`, `mlp`, `qkv`, ...), and their durations are summed
per part of the model:

    jaxpi bench profile --preset mid [--steps 2] [--trace-dir DIR] [--json]

On a GPU the trace's own kernel events are read (not the host's launches of them); a library
kernel (cuBLAS) is matched through the `hlo_op` the tracer attaches. Under CUDA graphs, XLA's
default, that is the graph ("command_buffer_N") rather than the op, so the time stays unmatched:
trace with XLA_FLAGS=--xla_gpu_enable_command_buffer= for a per-op breakdown.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpi.bench.config import BenchConfig
from jaxpi.bench.decode import random_model, step_bytes
from jaxpi.rollout.engine import SamplingParams
from jaxpi.rollout.jax_engine import JaxEngine

# (part, substrings of op_name that put an op there), first match wins: the innermost scopes first.
# "scan carry" collects the layer-group scan's own slicing and stacking (outside any layer scope).
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("deltanet: (I+A)^-1 and U, W (ut_transform)", ("ut_transform",)),
    ("deltanet: chunk scan (state carry)", ("chunk_scan",)),
    ("deltanet: intra-chunk Q·Kᵀ", ("intra_attention",)),
    ("deltanet: decays, masks, l2norm", ("decays", "chunk_masks", "l2norm_and_scale", "delta_rule")),
    ("deltanet: in-proj + conv", ("/conv",)),
    ("deltanet: gates (b, a)", ("/gates",)),
    ("deltanet: z, out-proj, gated norm", ("/mixer/out/",)),
    ("attention: scores, softmax, P·V", ("/scores", "/mask", "softmax", "bkgtu,bukd")),
    ("attention: q/k/v projections, norms, rope", ("/qkv",)),
    ("mlp", ("/mlp",)),
    ("mixer, other (o_proj, softmax reductions, residual)", ("/mixer",)),
    ("LM head", ("btd,dv->btv",)),
    ("scan carry (stacking residuals / weights per layer group)", ("dynamic_update_slice", "dynamic_slice")),
)


# One iteration of the engine's decode loop (`jaxpi.rollout.jax_engine`): the model's scopes under
# the loop body, and the engine's own (`sample`, `select_rows`). Ops XLA hoisted out of the loop
# (e.g. a weight conversion) keep the loop's op_name and run once per call: summed per step they
# are that call's cost spread over its steps.
DECODE_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampling (log-softmax, argmax / draw)", ("/sample",)),
    ("cache rows kept by the active mask (select_rows)", ("select_rows",)),
    ("deltanet: recurrent step", ("delta_rule",)),
    ("deltanet: in-proj + conv", ("/conv",)),
    ("deltanet: gates (b, a)", ("/gates",)),
    ("deltanet: z, out-proj, gated norm", ("/mixer/out/",)),
    ("attention: cache write", ("cache_update",)),
    ("attention: scores, softmax, P·V", ("/scores", "/mask", "softmax", "bkgtu,bukd")),
    ("attention: q/k/v projections, norms, rope", ("/qkv",)),
    ("mlp", ("/mlp",)),
    ("mixer, other (o_proj, residual, norms)", ("/mixer",)),
    ("LM head (and the engine's copy of its logits)", ("btd,dv->btv", "lm_head", "next_logits")),
    ("layer-group slicing", ("dynamic_slice", "dynamic_update_slice", "layer_groups")),
)


def part_of(op_name: str, parts: tuple[tuple[str, tuple[str, ...]], ...] = PARTS) -> str:
    for part, keys in parts:
        if any(k in op_name for k in keys):
            return part
    return "other"


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=(.*?)metadata=\{[^}]*op_name=\"([^\"]*)\"", re.M)
# Control flow: their trace events span their bodies' ops, which are traced too.
_CONTAINER = re.compile(r"\s(while|call|conditional)\(")
_INSTR_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=([^\n]*)", re.M)
# JAX wraps scopes in the transform that produced the op: "transpose(jvp(mixer))/delta_rule".
_WRAP = re.compile(r"\b(?:jvp|transpose|vmap|remat|checkpoint)\(")


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX op_name in its metadata, transform wrappers removed and
    "bwd:" prefixed where the op belongs to the backward pass (control-flow ops left out).

    An instruction XLA made without metadata (on the CPU, the matrix-vector `dot` it splits out of
    a `dot_general`) takes the op_name of a neighbour: the first of its users, then of its
    operands, that is the same product's (a `dot_general` op_name: the reshapes of its activation
    and result), else its first named user, else its first named operand."""
    out = {}
    for m in _INSTR.finditer(hlo_text):
        if _CONTAINER.search(m.group(2)):
            continue
        raw = m.group(3)
        clean = "/" + _WRAP.sub("", raw.split("/", 1)[-1]).replace(")", "")
        out[m.group(1)] = ("bwd:" if "transpose(" in raw else "fwd:") + clean
    bare, users, operands = [], collections.defaultdict(list), {}
    for m in _INSTR_LINE.finditer(hlo_text):
        name, rest = m.group(1), m.group(2)
        operands[name] = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        for operand in operands[name]:
            users[operand].append(name)
        if name not in out and "metadata=" not in rest and not _CONTAINER.search(rest):
            bare.append(name)
    for name in bare:
        near = [out[n] for n in (*users[name], *operands[name]) if n in out]
        product = [n for n in near if n.endswith("dot_general")]
        if product or near:
            out[name] = (product or near)[0]
    return out


def trace_events(trace_dir: Path) -> list[dict[str, Any]]:
    """Complete events of the newest trace; on an accelerator only the device's own (its kernels),
    so the host's launch events named after the same HLO ops are not counted twice."""
    files = sorted(trace_dir.rglob("*.trace.json.gz")) + sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no trace JSON under {trace_dir}")
    with gzip.open(files[-1], "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {
        e.get("pid"): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in process.items() if re.search(r"/device:(GPU|TPU)", name)}
    return [e for e in events if e.get("ph") == "X" and "dur" in e and (not device or e.get("pid") in device)]


def hlo_op_of(event: dict[str, Any], names: dict[str, str]) -> str | None:
    """The HLO instruction an event ran: its name (CPU thunks, most GPU fusions) or, for library
    kernels (cuBLAS, cuDNN) named after themselves, the `hlo_op` argument the tracer attached."""
    if event["name"] in names:
        return event["name"]
    op = event.get("args", {}).get("hlo_op")
    return op if op in names else None


# the kinds `_op_kind` gives a matmul: a cuBLAS call or Triton gemm fusion (GPU), a dot or a
# library fusion around one (CPU, TPU)
MATMUL_KINDS = ("cublas matmul", "triton matmul fusion", "dot")


def _op_kind(name: str, rest: str) -> str:
    if "__cublas" in rest:
        return "cublas matmul"
    if "kind=kCustom" in rest and "gemm" in name:
        return "triton matmul fusion"
    # a dot instruction, or (XLA:CPU) a custom fusion around one, e.g. "__ynn_fusion"
    if re.search(r"\bdot\(", rest) or (
        "kind=kCustom" in rest and re.search(r'op_name="[^"]*dot_general"', rest)
    ):
        return "dot"
    return "fusion" if " fusion(" in rest else "other"


def matmul_events(events: list[dict[str, Any]], hlo_text: str) -> list[dict[str, Any]]:
    """The events that ran one of the program's matmuls (`MATMUL_KINDS`), e.g. to time a matmul
    by its kernels alone, without the host's dispatch and synchronisation."""
    kind_of = {m.group(1): _op_kind(m.group(1), m.group(2)) for m in _INSTR_LINE.finditer(hlo_text)}
    return [e for e in events if kind_of.get(hlo_op_of(e, kind_of) or "") in MATMUL_KINDS]


def seconds_by_op_kind(events: list[dict[str, Any]], hlo_text: str, steps: int = 1) -> dict[str, float]:
    """Device seconds per step by kind of HLO op: library (cuBLAS) matmuls, Triton matmul
    fusions, other fusions, other ops; copies the runtime makes ("Memcpy…", "memset…"), and
    events naming an op the optimized HLO does not hold, apart."""
    kind_of = {m.group(1): _op_kind(m.group(1), m.group(2)) for m in _INSTR_LINE.finditer(hlo_text)}
    out: dict[str, float] = collections.defaultdict(float)
    for e in events:
        op = e["name"] if e["name"] in kind_of else e.get("args", {}).get("hlo_op", "")
        if op in kind_of:
            kind = kind_of[op]
        else:
            kind = "memcpy/memset" if e["name"].lower().startswith("mem") else "unknown op"
        out[kind] += e["dur"] * 1e-6 / steps
    return dict(out)


def busy_seconds(events: list[dict[str, Any]]) -> float:
    """The union of the events' [start, start + duration) intervals: on a device trace, the time
    some kernel ran (the rest of the wall time it waited on the host)."""
    busy, end = 0.0, -math.inf
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy * 1e-6


def summarize(
    events: list[dict[str, Any]],
    names: dict[str, str],
    steps: int,
    parts: tuple[tuple[str, tuple[str, ...]], ...] = PARTS,
) -> dict[str, Any]:
    """Seconds per step by model part (`parts`) and the top ops, from complete ("X") trace events
    that name an HLO instruction of the step."""
    per_part: dict[str, float] = collections.defaultdict(float)
    per_op: dict[str, float] = collections.defaultdict(float)
    per_pass: dict[str, float] = collections.defaultdict(float)
    unmatched: dict[str, float] = collections.defaultdict(float)
    for e in events:
        name = hlo_op_of(e, names)
        if name is None:
            unmatched[e["name"]] += e["dur"] * 1e-6 / steps
            continue
        sec = e["dur"] * 1e-6 / steps
        per_part[part_of(names[name], parts)] += sec
        per_op[name] += sec
        per_pass[names[name][:3]] += sec
    total = sum(per_part.values())
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:25]
    return {
        "op_seconds_per_step": total,
        "parts": {
            k: {"s": v, "share": v / total if total else 0.0}
            for k, v in sorted(per_part.items(), key=lambda kv: -kv[1])
        },
        "passes": dict(per_pass),
        "top_ops": [{"op": k, "s": v, "op_name": names[k]} for k, v in top],
        # events that name no HLO op of the step (runtime copies, other programs): listed, not parted
        "unmatched_seconds_per_step": sum(unmatched.values()),
        "top_unmatched": [
            {"name": k, "s": v} for k, v in sorted(unmatched.items(), key=lambda kv: -kv[1])[:10]
        ],
    }


def profile_train_step(
    bench: BenchConfig, *, steps: int = 2, trace_dir: str | Path | None = None
) -> dict[str, Any]:
    """Build and warm up the jaxpi step on a fresh random checkpoint, trace `steps` calls, and
    summarize the trace by model part."""
    from jaxpi.bench.train_step import bench_tokens, build_jaxpi_step, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="jaxpi-profile-") as tmp:
        ckpt = write_checkpoint(bench, Path(tmp) / "ckpt")
        built = build_jaxpi_step(bench, ckpt, bench_tokens(bench))
    step, batch = built["step"], built["batch"]
    params, opt = built["params"], built["opt_state"]
    for _ in range(bench.warmup):
        params, opt, metrics = step(params, opt, batch)
        jax.block_until_ready(metrics)
    out_dir = Path(trace_dir or tempfile.mkdtemp(prefix="jaxpi-trace-"))
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        for _ in range(steps):
            params, opt, metrics = step(params, opt, batch)
            jax.block_until_ready(metrics)
    hlo = step.as_text()
    (out_dir / "step.hlo.txt").write_text(hlo)  # to read an op's fusion after the fact
    res = summarize(trace_events(out_dir), op_names(hlo), steps)
    res["trace_dir"] = str(out_dir)
    res["steps"] = steps
    return res


def module_events(events: list[dict[str, Any]], module: str) -> list[dict[str, Any]]:
    """The events of one compiled program (XLA:CPU tags each op's event with its `hlo_module`)."""
    return [e for e in events if e.get("args", {}).get("hlo_module") == module]


def profile_decode(
    bench: BenchConfig,
    *,
    calls: int = 1,
    new_tokens: int = 64,
    prompt_len: int = 8,
    max_len: int | None = None,
    trace_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Trace `calls` greedy `generate` calls of the engine on the bench model (`bench.batch` rows,
    random prompts of `prompt_len`, `new_tokens` each, `max_len` the engine's cache length, by
    default just enough) after a warm-up, and sum the decode program's op time per loop
    iteration by model part (`DECODE_PARTS`)."""
    model = random_model(bench)
    max_len = max_len or prompt_len + new_tokens + 1
    engine = JaxEngine(model, max_len=max_len, batch_size=bench.batch)
    prompts = np.random.default_rng(bench.seed).integers(0, model.cfg.vocab_size, (bench.batch, prompt_len))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    for _ in range(bench.warmup):
        engine.generate(prompts.tolist(), params)
    out_dir = Path(trace_dir or tempfile.mkdtemp(prefix="jaxpi-trace-"))
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.generate(prompts.tolist(), params)
        wall = time.perf_counter() - t0
    hlo = engine.decode_hlo(params)
    (out_dir / "decode.hlo.txt").write_text(hlo)
    steps = calls * new_tokens  # no stop tokens: every row runs its whole budget, one token per iteration
    events = module_events(trace_events(out_dir), "jit_decode")
    res = summarize(events, op_names(hlo), steps, DECODE_PARTS)
    res["by_op_kind"] = seconds_by_op_kind(events, hlo, steps)
    res["busy_seconds_per_step"] = busy_seconds(events) / steps
    res["wall_seconds_per_step"] = wall / steps  # the whole generate: prefill and host work included
    res["bytes_per_step"] = step_bytes(
        model, batch=bench.batch, context=prompt_len + (new_tokens - 1) / 2, max_len=max_len
    )
    res.update(
        mode="decode", batch=bench.batch, new_tokens=new_tokens, max_len=max_len, calls=calls, steps=steps
    )
    res["trace_dir"] = str(out_dir)
    return res
