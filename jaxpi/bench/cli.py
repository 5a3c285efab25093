"""`jaxpi bench`: the sub-benchmarks behind one command, a human table and `--json`.

    jaxpi bench train-step [--preset mid|tiny] [--hidden N] [--layers N] [--seq N] [--batch N]
                           [--dtype float32|bfloat16] [--lora-rank R] [--repeats N] [--warmup N]
                           [--threads N] [--vs torch] [--json] [--out FILE]
    jaxpi bench gdn        [same model flags] [--vs torch|none]
    jaxpi bench decode     [same model flags] [--batches 1,16] [--new-tokens N] [--prompt-len N]
    jaxpi bench compile    [same model flags] --layers 8,16,64
    jaxpi bench all        [same model flags] [--compile-layers 8,16,64] [--vs torch|none]
    jaxpi bench profile    [same model flags] [--steps 2] [--trace-dir DIR]

The JSON report is one object: `env` (device, versions, threads, date), `config` and `results`,
one entry per sub-benchmark; every timed figure is {median, min, max, repeats, values}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxpi.bench import serve as serve_bench
from jaxpi.bench.config import DTYPES, PRESETS, BenchConfig, default_threads, make_config
from jaxpi.config import GDN_IMPLS, REMAT_POLICIES

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
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if with_torch:
        from jaxpi.bench.torch_step import torch_versions

        env.update(torch_versions())
    return env


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
    vs_torch = vs == "torch"
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
            bench, batches=_ints(args.batches), new_tokens=new, prompt_len=args.prompt_len
        )
    if command in ("compile", "all"):
        from jaxpi.bench.compile import compile_bench

        depths = args.layers if command == "compile" else args.compile_layers
        say("compile time")
        results["compile"] = compile_bench(bench, _ints(depths))
    if command == "profile":
        from jaxpi.bench.profile import profile_train_step

        say("profiling the jaxpi train step")
        results["profile"] = profile_train_step(bench, steps=args.steps, trace_dir=args.trace_dir)
    return report


# ---- the table -------------------------------------------------------------------------------
def _f(fig: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    med, lo, hi = (fmt.format(fig[k] * scale) for k in ("median", "min", "max"))
    return f"{med} ({lo}–{hi})"


def format_table(report: dict[str, Any]) -> str:
    env, cfg, res = report["env"], report["config"], report["results"]
    m = cfg["model"]
    lines = [
        f"jaxpi bench {report['command']}   {env['date']}   {env['device_kind']} ({env['platform']}), "
        f"{env['threads']} threads   jax {env['jax']}"
        + (f", torch {env['torch']}, transformers {env['transformers']}" if "torch" in env else ""),
        f"  model: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers {m['layer_types']}, "
        f"vocab {m['vocab_size']}   seq {cfg['seq']} × batch {cfg['batch']}, {cfg['dtype']}, "
        f"LoRA rank {cfg['lora_rank']}   median (min–max) of {cfg['repeats']} after {cfg['warmup']} warm-up"
        + (
            f"   kernels: gdn {m['gdn_impl']}, norms {m['norm_impl']}, attention {m.get('attn_impl', 'jax')}"
            if "pallas" in (m.get("gdn_impl"), m.get("norm_impl"), m.get("attn_impl"))
            else ""
        ),
    ]
    if "train_step" in res:
        r = res["train_step"]
        j, pk = r["jaxpi"], r["peak"]
        lines += [
            "",
            "train-step (LoRA fwd + bwd + AdamW)",
            f"  model FLOPs/step {r['flops']['total'] / 1e9:.4g} G   matmul peak "
            f"({pk['dtype']} {pk['n']}²) {_f(pk['flop_per_s'], 1e-9)} GFLOP/s"
            + (
                f", by kernel time {pk['kernel_timed']['median_tflops'] * 1e3:.4g} GFLOP/s"
                f" (MFU against the {pk.get('mfu_peak_source')} figure)"
                if "median_tflops" in pk.get("kernel_timed", {})
                else ""
            ),
            f"  jaxpi    step {_f(j['step_s'])} s   {_f(j['tokens_per_s'])} tokens/s   "
            f"{_f(j['flop_per_s'], 1e-9)} GFLOP/s   MFU {_f(j['mfu'], 100, '{:.1f}')} %   "
            f"compile {j['compile_s']:.1f} s",
        ]
        if "torch" in r:
            t = r["torch"]
            lines += [
                f"  torch    step {_f(t['step_s'])} s   {_f(t['tokens_per_s'])} tokens/s   "
                f"{t['flop_per_s']['median'] / 1e9:.3g} GFLOP/s   MFU {100 * t['mfu']:.1f} %",
                f"  jaxpi / torch tokens/s: {r['speedup_tokens_per_s']:.2f}× (ratio of medians)   first-step loss "
                f"jaxpi {j['loss_first']:.5f}  torch {t['loss_first']:.5f}",
            ]
            if "speedup_pairs" in r:
                lines.append(
                    f"  jaxpi / torch per back-to-back pair: {_f(r['speedup_pairs'], 1, '{:.2f}')}×   "
                    f"jaxpi MFU vs each repeat's adjacent peak {_f(j['mfu_adjacent'], 100, '{:.1f}')} % "
                    f"(peak {_f(j['peak_adjacent'], 1e-9)} GFLOP/s, wall clock)"
                )
    if "gdn" in res:
        g = res["gdn"]
        s = g["shape"]
        lines += [
            "",
            f"gdn (chunked gated delta rule, B {s['batch']} T {s['seq']} H {s['heads']} "
            f"Dk {s['dk']} Dv {s['dv']} chunk {s['chunk']})",
            f"  jaxpi    fwd {_f(g['jaxpi']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['jaxpi']['fwd_bwd_s'], 1e3)} ms"
            f"   ({g.get('impl', 'jax')}{', interpreted' if g.get('interpreted') else ''})",
        ]
        if "plain_jax" in g:
            impl = g["impl"]
            fwd, fwd_bwd = g[f"speedup_{impl}_fwd"], g[f"speedup_{impl}_fwd_bwd"]
            lines += [
                f"  plain JAX fwd {_f(g['plain_jax']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['plain_jax']['fwd_bwd_s'], 1e3)} ms",
                f"  plain JAX / {impl} time: fwd {fwd:.2f}×   fwd+bwd {fwd_bwd:.2f}×   "
                f"max |Δ out| {g[f'max_abs_diff_{impl}_vs_plain']:.2e}",
            ]
        if "torch" in g:
            lines += [
                f"  torch    fwd {_f(g['torch']['fwd_s'], 1e3)} ms   fwd+bwd {_f(g['torch']['fwd_bwd_s'], 1e3)} ms",
                f"  torch / jaxpi time: fwd {g['speedup_fwd']:.2f}×   fwd+bwd {g['speedup_fwd_bwd']:.2f}×"
                f"   max |Δ out| {g['max_abs_diff']:.2e}",
            ]
    if "decode" in res:
        d = res["decode"]
        lines += [
            "",
            f"decode (JaxEngine, greedy, {d['prompt_len']}-token prompts, {d['new_tokens']} new tokens)",
        ]
        for b, v in d["batches"].items():
            lines.append(f"  batch {b:>3}   {_f(v['tokens_per_s'])} tokens/s   call {_f(v['call_s'])} s")
    if "compile" in res:
        c = res["compile"]
        lines += ["", "compile (LoRA train step, trace + lower + compile)"]
        for n, v in c["layers"].items():
            lines.append(
                f"  {n:>3} layers   {_f(v['total_s'])} s   (lower {v['lower_s']['median']:.2f}, "
                f"compile {v['compile_s']['median']:.2f})"
                + (f"   CPU {_f(v['cpu_s'])} s" if "cpu_s" in v else "")
            )
        lines.append(
            f"  {c['deepest']} / {c['shallowest']} layers: {c['ratio_deepest_over_shallowest']:.2f}×"
            + (
                f" wall, {c['ratio_cpu_deepest_over_shallowest']:.2f}× CPU"
                if "ratio_cpu_deepest_over_shallowest" in c
                else ""
            )
        )
    if "profile" in res:
        pr = res["profile"]
        lines += [
            "",
            f"profile (jaxpi train step, op time per step {pr['op_seconds_per_step']:.3g} s; trace {pr['trace_dir']})",
        ]
        for part, v in pr["parts"].items():
            lines.append(f"  {100 * v['share']:5.1f} %  {v['s']:8.4f} s  {part}")
        lines.append("  top ops:")
        for op in pr["top_ops"][:12]:
            lines.append(f"    {op['s']:8.4f} s  {op['op']:<28} {op['op_name'][-90:]}")
    return "\n".join(lines)


# ---- argparse --------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _model_flags(p: argparse.ArgumentParser, *, depth_list: bool) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="starting config (default tiny)")
    p.add_argument("--hidden", type=int, default=None)
    if depth_list:
        p.add_argument("--layers", default="8,16,64", help="depths to compile, comma-separated")
    else:
        p.add_argument("--layers", type=int, default=None, help="model depth")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--remat", choices=list(REMAT_POLICIES), default=None)
    p.add_argument(
        "--kernels",
        choices=["jax", "pallas"],
        default=None,
        help="the model's kernel path for the gated delta rule, the norms and the causal attention "
        "(default jax; pallas is interpreted on CPU)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (figures are their median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (the first compiles)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for XLA and torch (default: all this process may use)",
    )
    p.add_argument("--peak-n", type=int, default=None, help="side of the matmul-peak square")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vs", choices=["torch", "none"], default=None, help="also run transformers' version")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")


def add_subparser(sub: Any) -> None:
    """Register `jaxpi bench` on the top-level subparsers."""
    bench = sub.add_parser(
        "bench",
        help="measured speed: LoRA train step (MFU, vs torch), DeltaNet kernel, decode, compile time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inner = bench.add_subparsers(dest="bench_command", required=True)
    specs = {
        "train-step": "the LoRA SFT step: tokens/s, FLOP/s, MFU against the measured matmul peak",
        "gdn": "the chunked gated delta rule alone, fwd and fwd+bwd, against transformers' torch function",
        "decode": "the embedded engine's decode tokens/s at several batch sizes",
        "compile": "compile time of the train step at several depths",
        "all": "every benchmark above in one run",
        "profile": "trace the jaxpi train step and sum op time by model part (jax.profiler)",
    }
    for name, text in specs.items():
        p = inner.add_parser(name, help=text, description=text)
        _model_flags(p, depth_list=name == "compile")
        if name in ("decode", "all"):
            p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
            p.add_argument("--new-tokens", type=int, default=None, help="default: 16 (tiny), 64 (mid)")
            p.add_argument("--prompt-len", type=int, default=8)
        if name in ("gdn", "all"):
            p.add_argument(
                "--impl",
                choices=list(GDN_IMPLS),
                default="jax",
                help="jaxpi's DeltaNet kernel: jax (sequential chunk scan), jax_assoc (log-depth), "
                "jax_split (state-only scan + chunk-parallel products), pallas / pallas_split (kernels); "
                "any but jax also times jax",
            )
        if name == "all":
            p.add_argument("--compile-layers", default="8,16,64")
        if name == "profile":
            p.add_argument("--steps", type=int, default=2, help="traced steps (after the warm-up)")
            p.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temp dir)")
        p.set_defaults(fn=cmd_bench)
    p = inner.add_parser("serve", help=serve_bench.HELP, description=serve_bench.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    serve_bench.add_arguments(p)
    p.set_defaults(fn=serve_bench.cmd_serve)


def _limit_threads(n: int) -> None:
    """Run on the first n CPUs of this process's set: XLA's and torch's pools follow the mask
    (set before the JAX backend starts to size XLA's pool by it)."""
    cpus = sorted(os.sched_getaffinity(0))
    if 0 < n < len(cpus):
        os.sched_setaffinity(0, cpus[:n])


def cmd_bench(args: argparse.Namespace) -> int:
    command = args.bench_command
    if args.threads:
        _limit_threads(args.threads)
    bench = make_config(
        args.preset,
        hidden=args.hidden,
        layers=None if command == "compile" else args.layers,
        intermediate=args.intermediate,
        vocab=args.vocab,
        remat=args.remat,
        kernels=args.kernels,
        seq=args.seq,
        batch=args.batch,
        lora_rank=args.lora_rank,
        peak_n=args.peak_n,
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=default_threads(),  # after _limit_threads: what XLA and torch actually get
        seed=args.seed,
    )
    report = run(command, bench, args)
    text = json.dumps(report, indent=2)
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)
    print(text if args.json else format_table(report))
    return 0
