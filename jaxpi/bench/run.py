"""Running `jaxpi bench`: the environment, the sub-benchmarks in order, one JSON report."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any

from jaxpi.bench.config import BenchConfig

# Decode budget per preset: enough tokens that the loop, not the prefill, dominates.
NEW_TOKENS = {"tiny": 16, "mid": 64}


# ---- running ---------------------------------------------------------------------------------
_T0 = time.perf_counter()


def say(msg: str) -> None:
    """Progress on stderr (stdout carries only the table or the JSON)."""
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def environment(bench: BenchConfig, with_torch: bool) -> dict[str, Any]:
    import flax
    import jax
    import jaxlib

    dev = jax.devices()[0]
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": str(dev),
        "device_kind": getattr(dev, "device_kind", "?"),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "threads": bench.threads,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if with_torch:
        from jaxpi.bench.torch_step import torch_versions

        env.update(torch_versions())
    return env


def cpu_model() -> str | None:
    """The host CPU's model name (Linux: /proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_train_step(bench: BenchConfig, *, vs_torch: bool) -> dict[str, Any]:
    """Matmul peak, then the jaxpi step (and the torch step) on one checkpoint and token batch.

    With torch, both steps are built and warmed up first, then their timed repeats alternate
    (jaxpi, torch, jaxpi, ...), each jaxpi repeat preceded by a short matmul-peak probe: a pair
    of repeats, and a repeat and its peak, run back to back under about the same load.
    """
    from jaxpi.bench.flops import train_step_flops
    from jaxpi.bench.peak import matmul_peak, peak_probe
    from jaxpi.bench.timing import pair_ratios, rate, ratio
    from jaxpi.bench.train_step import (
        bench_tokens,
        jaxpi_figures,
        jaxpi_step_runner,
        jaxpi_train_step,
        write_checkpoint,
    )

    say(f"matmul peak ({bench.dtype}, n={bench.peak_n})")
    peak = matmul_peak(bench.peak_n, bench.dtype, warmup=2, repeats=max(bench.repeats, 3))
    ids = bench_tokens(bench)
    res: dict[str, Any] = {
        "flops": train_step_flops(bench.model, seq=bench.seq, batch=bench.batch, lora_rank=bench.lora_rank),
        "peak": peak,
    }
    with tempfile.TemporaryDirectory(prefix="jaxpi-bench-") as tmp:
        say("random checkpoint (transformers)")
        ckpt = write_checkpoint(bench, tmp)
        if not vs_torch:
            say("jaxpi train step")
            res["jaxpi"] = jaxpi_train_step(bench, ckpt, ids, peak["mfu_peak"])
            return res
        from jaxpi.bench.timing import interleaved
        from jaxpi.bench.torch_step import torch_figures, torch_step_runner

        say("jaxpi train step: load and compile")
        jax_call, built = jaxpi_step_runner(bench, ckpt, ids)
        say("transformers + peft train step: load")
        torch_call, info = torch_step_runner(bench, ckpt, ids)
        probe = peak_probe(bench.peak_n, bench.dtype)
        adjacent: list[float] = []

        def before(name: str, _: int) -> None:
            if name == "jaxpi":
                adjacent.append(probe())

        times, first = interleaved(
            {"jaxpi": jax_call, "torch": torch_call},
            warmup=bench.warmup,
            repeats=bench.repeats,
            before=before,
            progress=say,
        )
    res["jaxpi"] = jaxpi_figures(bench, times["jaxpi"], first["jaxpi"], built, peak["mfu_peak"], adjacent)
    res["torch"] = t = torch_figures(bench, times["torch"], first["torch"], info)
    res["interleaved"] = True
    # > 1: jaxpi processes more tokens per second than transformers + peft
    res["speedup_tokens_per_s"] = ratio(res["jaxpi"]["tokens_per_s"], t["tokens_per_s"])
    # the same, per pair of back-to-back repeats (torch time / jaxpi time), then their median
    res["speedup_pairs"] = pair_ratios(times["torch"], times["jaxpi"])
    t["flop_per_s"] = rate(res["flops"]["total"], t["step_s"]["values"])
    t["mfu"] = t["flop_per_s"]["median"] / peak["mfu_peak"]
    return res


def run(command: str, bench: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The report of one `jaxpi bench` subcommand."""
    vs = args.vs if args.vs is not None else ("none" if command == "train-step" else "torch")
    vs_torch = vs == "torch" and command != "decode"
    report: dict[str, Any] = {
        "command": command,
        "env": environment(bench, vs_torch),
        "config": bench.to_json(),
        "results": {},
    }
    results = report["results"]
    if command in ("train-step", "all"):
        results["train_step"] = run_train_step(bench, vs_torch=vs_torch)
    if command in ("gdn", "all"):
        from jaxpi.bench.gdn import gdn_bench

        say("chunked gated delta rule")
        results["gdn"] = gdn_bench(bench, vs_torch=vs_torch, impl=args.impl)
    if command in ("decode", "all"):
        from jaxpi.bench.decode import decode_bench

        new = args.new_tokens or NEW_TOKENS.get(bench.preset, 64)
        say("decode")
        results["decode"] = decode_bench(
            bench,
            batches=parse_ints(args.batches),
            new_tokens=new,
            prompt_len=args.prompt_len,
            max_len=args.max_len,
            vs="vllm" if vs == "vllm" else "none",
            checkpoint=args.checkpoint,
            vllm_url=args.vllm_url,
            pause_vllm=not args.keep_vllm_running,
            progress=say,
        )
    if command in ("compile", "all"):
        from jaxpi.bench.compile import compile_bench

        depths = args.layers if command == "compile" else args.compile_layers
        say("compile time")
        results["compile"] = compile_bench(bench, parse_ints(depths))
    if command == "profile" and args.mode == "decode":
        from jaxpi.bench.profile import profile_decode

        say(f"profiling the engine's decode loop at batch {bench.batch}")
        new = args.new_tokens or NEW_TOKENS.get(bench.preset, 64)
        results["profile"] = profile_decode(
            bench,
            calls=args.steps,
            new_tokens=new,
            prompt_len=args.prompt_len,
            max_len=args.max_len,
            trace_dir=args.trace_dir,
        )
    elif command == "profile":
        from jaxpi.bench.profile import profile_train_step

        say("profiling the jaxpi train step")
        results["profile"] = profile_train_step(bench, steps=args.steps, trace_dir=args.trace_dir)
    return report


def parse_ints(text: str) -> list[int]:
    """Comma-separated integers: "1,16" -> [1, 16]."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
