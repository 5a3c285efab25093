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
import json
import os
from pathlib import Path
from typing import Any

from jaxpi.bench import serve as serve_bench
from jaxpi.bench.config import DTYPES, PRESETS, default_threads, make_config
from jaxpi.bench.run import run
from jaxpi.bench.table import format_table
from jaxpi.cli.registry import help_for
from jaxpi.config import GDN_IMPLS, REMAT_POLICIES


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
    """Register `jaxpi bench`."""
    bench = sub.add_parser(
        "bench",
        help=help_for("bench"),
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
