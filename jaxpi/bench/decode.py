"""Decoding throughput of the embedded engine (`jaxpi.rollout.JaxEngine`) at several batch sizes,
against the memory-bandwidth limit and, with `vs="vllm"`, against vLLM on the same checkpoint.

Random weights of the bench model (or a given checkpoint), a short random prompt per row, greedy
sampling of a fixed number of new tokens (no stop tokens, so every row runs to its budget). One
timed call is one `generate`: the prompt's prefill plus the decode loop.

Bandwidth: a decode step at a small batch is bound by the bytes it must move, not by arithmetic.
`step_bytes` counts them (every weight read once, each row's embedding row, the cache rows read
and written), and the fraction of the limit is

    bytes per step × steps per second / copy bandwidth      (`jaxpi.bench.bandwidth`)

with the copy bandwidth probed right before and right after each jaxpi repeat (its call and its
one-token call), in the same process, and each repeat held to the mean of its two probes. Two rates of
steps: the whole call's (new tokens over the call's time, prefill included: `bandwidth_fraction`)
and the decode step's (`bandwidth_fraction_per_step`): each timed call is followed by the same call
for one new token, and a step takes (call - one-token call) / (new tokens - 1), the time per
output token after the first as vLLM's benchmarks count it; both engines are timed so. With vLLM,
both engines run on one bf16 checkpoint and the same prompts, their timed repeats alternating
(jaxpi, vLLM, jaxpi, ...), so a pair of repeats runs under about the same load. A vLLM server
started here is stopped (SIGSTOP to its process group) during jaxpi's turns and the bandwidth
probes, and continued (SIGCONT) for its own: its idle engine keeps a core busy, which on a
2-core machine took about a quarter off jaxpi's batch-1 rate (docs/performance.md). A server
given by URL keeps running (`vllm.paused_during_jaxpi` is false in the report).
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpi.bench.bandwidth import bandwidth_probe, copy_bandwidth
from jaxpi.bench.config import BenchConfig
from jaxpi.bench.timing import figure, interleaved, pair_ratios
from jaxpi.convert.hf import load_hf
from jaxpi.hf_fixtures import make_checkpoint, random_jax_model
from jaxpi.rollout.engine import SamplingParams
from jaxpi.rollout.jax_engine import JaxEngine
from jaxpi.vllm.engine import VLLMEngine, VLLMEngineConfig
from jaxpi.vllm.server import ServerConfig, VLLMServer
from jaxpi.vllm.setup import VLLM_CPU_VERSION

# vLLM's CPU backend runs bfloat16 only (its Gated DeltaNet kernel refuses float32).
VLLM_DTYPE = "bfloat16"


def random_model(bench: BenchConfig) -> Any:
    """The bench model with seeded noise in every weight (no initialisers run)."""
    return random_jax_model(bench.model, bench.seed, bench.dtype)


def step_bytes(model: Any, *, batch: int, context: float, max_len: int) -> dict[str, float]:
    """Bytes one decode step must move with `batch` rows holding `context` tokens each.

    weights: every parameter once, except the input embedding, of which each row reads its own
    row (the LM head reads the whole table when the two are tied); cache: each attention layer
    reads the keys and values of the `context` positions and writes one position per row, each
    DeltaNet layer reads and writes its conv window and recurrent state whole. The engine's cache
    layout (`init_cache(batch, max_len)`: dtypes, the float32 recurrent state) sets the sizes.
    """
    weights = embed_rows = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        if path == ("embed",) and not model.cfg.tie_word_embeddings:
            embed_rows = batch * value.nbytes / value.shape[0]
        else:
            weights += value.nbytes
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    kv_read = kv_write = state = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        name = getattr(path[-1], "key", None)
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
        if name in ("k", "v"):  # [(groups,) B, H, S, D]: per position, all rows
            per_position = nbytes / leaf.shape[-2]
            kv_read += per_position * context
            kv_write += per_position
        elif name in ("conv", "state"):
            state += 2 * nbytes
    parts = {
        "weights": weights,
        "embedding_rows": embed_rows,
        "kv_read": kv_read,
        "kv_write": kv_write,
        "recurrent_state_read_write": state,
    }
    return {**parts, "total": sum(parts.values())}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How far two engines' greedy tokens agree row by row (bf16 kernels round differently, so a
    near-tie can flip a token and everything after it): rows identical, mean common prefix."""
    prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "rows": len(prefixes),
        "rows_identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "mean_common_prefix": float(np.mean(prefixes)) if prefixes else 0.0,
        "min_common_prefix": min(prefixes) if prefixes else 0,
    }


def decode_bench(
    bench: BenchConfig,
    *,
    batches: Sequence[int] = (1, 16),
    new_tokens: int = 64,
    prompt_len: int = 8,
    max_len: int | None = None,
    vs: str = "none",
    checkpoint: str | Path | None = None,
    vllm_url: str | None = None,
    pause_vllm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokens/s (generated tokens over `generate` time) and the bandwidth fraction per batch size;
    with `vs="vllm"`, vLLM's figures beside them from an interleaved run.

    `checkpoint`: a HF checkpoint directory to load instead of random bench weights (needed with
    vLLM unless the bench writes one: it then writes a random bf16 checkpoint of the bench model).
    `vllm_url`: a running vLLM server that serves `checkpoint` (else one is started on it).
    `max_len`: the engine's cache length per row (vLLM's max model length); by default just
    enough for the prompt and the new tokens.
    `pause_vllm`: stop a server started here during jaxpi's turns (see the module docstring).
    """
    say = progress or (lambda msg: None)
    if new_tokens < 1 or prompt_len < 1 or not batches or min(batches) < 1:
        raise ValueError("decode needs new_tokens >= 1, prompt_len >= 1 and batch sizes >= 1")
    if vs not in ("none", "vllm"):
        raise ValueError(f"decode compares against vllm or none, got {vs!r}")
    if vs == "vllm" and bench.dtype != VLLM_DTYPE:
        raise ValueError(f"--vs vllm needs --dtype {VLLM_DTYPE}: vLLM's CPU backend runs bf16 only")
    if vllm_url and (vs != "vllm" or checkpoint is None):
        raise ValueError("vllm_url needs vs='vllm' and the checkpoint that server serves")
    max_len = max_len or prompt_len + new_tokens + 1
    if max_len < prompt_len + new_tokens + 1:
        raise ValueError(f"max_len {max_len} does not hold {prompt_len} + {new_tokens} tokens")
    with tempfile.TemporaryDirectory(prefix="jaxpi-decode-") as tmp:
        if checkpoint is None and vs == "vllm":
            say("random bf16 checkpoint of the bench model (transformers)")
            checkpoint = make_checkpoint(Path(tmp) / "ckpt", bench.model, seed=bench.seed, dtype=VLLM_DTYPE)
        model = random_model(bench) if checkpoint is None else load_hf(checkpoint, bench.dtype)[1]
        cfg = model.cfg
        out: dict[str, Any] = {
            "new_tokens": new_tokens,
            "prompt_len": prompt_len,
            "max_len": max_len,
            "vs": vs,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "model": {
                "hidden_size": cfg.hidden_size,
                "num_hidden_layers": cfg.num_hidden_layers,
                "vocab_size": cfg.vocab_size,
                "dtype": bench.dtype,
            },
            "batches": {},
        }
        say("copy bandwidth")
        out["bandwidth"] = copy_bandwidth(repeats=3)
        probe = bandwidth_probe()
        server = veng = None
        pauser = Pauser(None)
        try:
            if vs == "vllm":
                server, veng = _vllm(checkpoint, vllm_url, max_len, max(batches), say)
                pauser = Pauser(server.pid if server is not None and pause_vllm else None)
                out["vllm"] = {
                    "url": veng.cfg.url,
                    "started_here": server is not None,
                    "paused_during_jaxpi": pauser.pgid is not None,
                    "version": VLLM_CPU_VERSION,
                }
                if server is not None:
                    out["vllm"]["startup_s"] = server.startup_s
            for b in batches:
                say(f"decode at batch {b}")
                out["batches"][str(b)] = _one_batch(
                    model, veng, b, new_tokens, prompt_len, max_len, bench, probe, say, pauser
                )
        finally:
            pauser.resume()
            if veng is not None:
                veng.shutdown()
            if server is not None:
                server.stop()
    out["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return out


def group_states(pgid: int) -> set[str]:
    """The scheduler states (R, S, T, ...) of the processes in group `pgid`, from /proc (empty
    where there is no /proc)."""
    states = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            states.add(fields[0])
    return states


class Pauser:
    """SIGSTOP / SIGCONT to a process group (a vLLM server started here), or nothing for None.
    `pause` and `resume` are idempotent; `resume` runs before the server is stopped for good.
    `pause` returns once every process of the group has stopped (a signal is delivered to a
    process running on another core only when that core next enters the kernel), at most
    `settle_s` later."""

    def __init__(self, pgid: int | None, settle_s: float = 2.0) -> None:
        self.pgid = pgid
        self.paused = False
        self.settle_s = settle_s

    def _send(self, sig: int) -> None:
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:  # the server died: its engine's next call says so
                self.pgid = None

    def pause(self) -> None:
        if not self.paused:
            self._send(signal.SIGSTOP)
            self.paused = True
            deadline = time.monotonic() + self.settle_s
            while self.pgid is not None and group_states(self.pgid) - {"T", "t", "Z", "X"}:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)

    def resume(self) -> None:
        if self.paused:
            self._send(signal.SIGCONT)
            self.paused = False


def _vllm(
    checkpoint: str | Path, url: str | None, max_len: int, max_batch: int, say: Callable[[str], None]
) -> tuple[VLLMServer | None, VLLMEngine]:
    """(the server started here or None, a `VLLMEngine` on it): no LoRA (the bench serves the base
    model, as jaxpi decodes it), room for `max_batch` sequences at once."""
    server = None
    if url is None:
        server = VLLMServer(
            ServerConfig(
                model=str(checkpoint),
                enable_lora=False,
                max_model_len=max(max_len, 16),
                kv_cache_bytes=1024**3,
                extra_args=("--max-num-seqs", str(max(max_batch, 8))),
            )
        )
        server.start(log=say)
        url = server.url
    engine = VLLMEngine(
        VLLMEngineConfig(url=url, max_len=max_len, batch_size=max_batch, concurrency=max_batch)
    )
    return server, engine


def _one_batch(
    model: Any,
    veng: VLLMEngine | None,
    b: int,
    new_tokens: int,
    prompt_len: int,
    max_len: int,
    bench: BenchConfig,
    probe: Callable[[], float],
    say: Callable[[str], None],
    pauser: Pauser,
) -> dict[str, Any]:
    """One batch size: both engines warmed up, then their timed repeats alternating (vLLM's
    server paused through jaxpi's calls and the probes where `pauser` has one)."""
    rng = np.random.default_rng(bench.seed + b)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompts = rng.integers(0, model.cfg.vocab_size, (b, prompt_len)).tolist()
    engine = JaxEngine(model, max_len=max_len, batch_size=b)
    outputs: dict[str, list] = {"jaxpi": [], "vllm": []}

    def call(eng: Any, name: str, sampling: SamplingParams) -> Callable[[], int]:
        def run() -> int:
            (pauser.pause if name == "jaxpi" else pauser.resume)()
            done = eng.generate(prompts, sampling)
            if sampling is params:
                outputs[name] = [c.token_ids for c in done]
            return sum(len(c.token_ids) for c in done)

        return run

    engines = {"jaxpi": engine} if veng is None else {"jaxpi": engine, "vllm": veng}
    fns: dict[str, Callable[[], int]] = {}
    for name, eng in engines.items():
        fns[name] = call(eng, name, params)
        if new_tokens > 1:  # the same prompts for one new token: the prefill and the first token
            fns[f"{name}/1"] = call(eng, name, SamplingParams(temperature=0.0, max_new_tokens=1))
    # The copy bandwidth on both sides of each jaxpi repeat (its call and its one-token call): on a
    # shared machine the probe moved by 1.5x within a minute, so each repeat is held to the mean
    # of the two probes that bracket it.
    probes: dict[str, list[float]] = {"before": [], "after": []}
    last = "jaxpi/1" if "jaxpi/1" in fns else "jaxpi"

    def before(name: str, _: int) -> None:
        if name == "jaxpi":
            pauser.pause()
            probes["before"].append(probe())

    def after(name: str, _: int) -> None:
        if name == last:
            pauser.pause()
            probes["after"].append(probe())

    times, first = interleaved(
        fns, warmup=bench.warmup, repeats=bench.repeats, before=before, after=after, progress=say
    )
    adjacent = [(a + z) / 2 for a, z in zip(probes["before"], probes["after"], strict=True)]
    nbytes = step_bytes(model, batch=b, context=prompt_len + (new_tokens - 1) / 2, max_len=max_len)
    res: dict[str, Any] = {
        "bytes_per_step": nbytes,
        "bandwidth_adjacent": figure(adjacent),
        "bandwidth_probes": probes,
    }
    for name in engines:
        generated = sum(len(t) for t in outputs[name])
        steps = [new_tokens / t for t in times[name]]
        res[name] = {
            "generated_tokens": generated,
            "call_s": figure(times[name]),
            "tokens_per_s": figure([generated / t for t in times[name]]),
            "steps_per_s": figure(steps),
            # against the probes that bracket this repeat
            "bandwidth_fraction": figure(
                [nbytes["total"] * s / bw for s, bw in zip(steps, adjacent, strict=True)]
            ),
            "first_call_s": first[name],
        }
        if new_tokens > 1:
            # A decode step's time: the call less the same call for one new token, over the other
            # new_tokens - 1 steps (the prefill and first token taken out, as vLLM's time per
            # output token); the repeats of the two calls pair up in order.
            step_s = [
                (t - t1) / (new_tokens - 1) for t, t1 in zip(times[name], times[f"{name}/1"], strict=True)
            ]
            res[name] |= {
                "one_token_call_s": figure(times[f"{name}/1"]),
                "decode_step_s": figure(step_s),
                "bandwidth_fraction_per_step": figure(
                    [nbytes["total"] / s / bw for s, bw in zip(step_s, adjacent, strict=True)]
                ),
            }
    if veng is not None:
        j, v = res["jaxpi"], res["vllm"]
        # > 1: jaxpi generates more tokens per second than vLLM
        res["speedup_tokens_per_s"] = j["tokens_per_s"]["median"] / v["tokens_per_s"]["median"]
        res["speedup_pairs"] = pair_ratios(times["vllm"], times["jaxpi"])
        if new_tokens > 1:  # > 1: jaxpi's decode step is the shorter
            res["speedup_decode_step"] = v["decode_step_s"]["median"] / j["decode_step_s"]["median"]
        res["greedy_agreement"] = greedy_agreement(outputs["jaxpi"], outputs["vllm"])
    del engine
    jax.clear_caches()
    return res
