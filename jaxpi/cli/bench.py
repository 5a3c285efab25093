"""`jaxpi bench`: the sub-benchmarks behind one command, a human table and `--json`.

    jaxpi bench train-step [--preset mid|tiny] [--hidden N] [--layers N] [--seq N] [--batch N]
                           [--dtype float32|bfloat16] [--lora-rank R] [--repeats N] [--warmup N]
                           [--threads N] [--vs torch] [--json] [--out FILE]
    jaxpi bench gdn        [same model flags] [--vs torch|none]
    jaxpi bench decode     [same model flags] [--batches 1,16] [--new-tokens N] [--prompt-len N]
                           [--vs vllm [--checkpoint DIR] [--vllm-url URL]]
    jaxpi bench compile    [same model flags] --layers 8,16,64
    jaxpi bench all        [same model flags] [--compile-layers 8,16,64] [--vs torch|none]
    jaxpi bench profile    [same model flags] [--steps 2] [--trace-dir DIR]
                           [--mode decode [--batch N] [--new-tokens N] [--prompt-len N]]
    jaxpi bench fleet      [--workers 1,2,4] [--collections 3] [--ray-address HOST:PORT]
    jaxpi bench gpu        --out FILE [--seq N] [--steps N] [--remat P] [--loss-chunk N] [--skip ...]
                           (the 27B-shaped run on one accelerator; its own flags, see its --help)

Each also takes --config NAME (configs/bench/NAME.yaml; bench serve: configs/bench-serve/) and
trailing key=value overrides of the keys its --help lists (docs/config.md).

The JSON report is one object: `env` (device, versions, threads, date), `config` and `results`,
one entry per sub-benchmark; every timed figure is {median, min, max, repeats, values}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from jaxpi.atomic import write_text
from jaxpi.bench import gpu_flags
from jaxpi.bench import serve as serve_bench
from jaxpi.bench.config import (
    DTYPES,
    KERNELS,
    PRESETS,
    PROFILE_MODES,
    RUN_CONFIGS,
    VS,
    BenchRunConfig,
    FleetRunConfig,
)
from jaxpi.bench.run import run
from jaxpi.bench.table import format_table
from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.cli.serving import or_none
from jaxpi.config import GDN_IMPLS, REMAT_POLICIES

FLEET_DOC = """GRPO collections on a Ray fleet: attempts per minute against the number of rollout
workers (the toy lookup environment on a tiny random base; jaxpi/bench/fleet.py)."""


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _model_flags(*, depth_list: bool) -> tuple[Flag, ...]:
    """The flags every model benchmark shares (`compile` takes a list of depths)."""
    return (
        Flag("--preset", "preset", "starting config (default tiny)", choices=sorted(PRESETS)),
        Flag("--hidden", "hidden"),
        Flag("--layers", "layers", "depths to compile, comma-separated" if depth_list else "model depth"),
        Flag("--intermediate", "intermediate", "MLP width"),
        Flag("--vocab", "vocab"),
        Flag("--seq", "seq"),
        Flag("--batch", "batch"),
        Flag("--dtype", "dtype", choices=DTYPES),
        Flag("--lora-rank", "lora_rank"),
        Flag("--remat", "remat", choices=list(REMAT_POLICIES)),
        Flag(
            "--kernels",
            "kernels",
            "the model's kernel path for the gated delta rule, the norms and the causal attention "
            "(default jax; pallas is interpreted on CPU)",
            choices=list(KERNELS),
        ),
        Flag("--repeats", "repeats", "timed repeats (figures are their median)"),
        Flag("--warmup", "warmup", "untimed calls first (the first compiles)"),
        Flag("--threads", "threads", "CPU threads for XLA and torch (default: all this process may use)"),
        Flag("--peak-n", "peak_n", "side of the matmul-peak square"),
        Flag("--seed", "seed"),
        Flag(
            "--vs",
            "vs",
            "also run transformers' version (torch), or, for decode, vLLM's engine on the same "
            "bf16 checkpoint (vllm)",
            choices=list(VS),
        ),
    )


DECODE_FLAGS = (
    Flag("--batches", "batches", "decode batch sizes, comma-separated"),
    Flag("--new-tokens", "new_tokens", "default: 16 (tiny), 64 (mid)", convert=or_none),
    Flag("--prompt-len", "prompt_len"),
    Flag("--max-len", "max_len", "the engine's cache length per row (default: prompt + new tokens + 1)"),
    Flag("--checkpoint", "checkpoint", "a HF checkpoint to decode (default: random bench weights)"),
    Flag("--vllm-url", "vllm_url", "with --vs vllm: a running server that serves --checkpoint"),
    Flag(
        "--keep-vllm-running",
        "keep_vllm_running",
        "with --vs vllm: leave the server started here running during jaxpi's turns "
        "(default: stopped with SIGSTOP while jaxpi decodes; an idle vLLM server keeps a core busy)",
    ),
)
PROFILE_FLAGS = (
    Flag("--steps", "steps", "traced steps (mode decode: traced generate calls), after the warm-up"),
    Flag("--trace-dir", "trace_dir", "keep the trace here (default: a temp dir)"),
    Flag(
        "--mode",
        "mode",
        "train (the LoRA step) or decode (the engine's decode loop)",
        choices=list(PROFILE_MODES),
    ),
    Flag("--new-tokens", "new_tokens", "mode decode: default 16 (tiny), 64 (mid)", convert=or_none),
    Flag("--prompt-len", "prompt_len", "mode decode"),
    Flag("--max-len", "max_len", "mode decode: the engine's cache length per row"),
)
GDN_FLAGS = (
    Flag(
        "--impl",
        "impl",
        "jaxpi's DeltaNet kernel: jax (sequential chunk scan), jax_assoc (log-depth), "
        "jax_split (state-only scan + chunk-parallel products), pallas / pallas_split (kernels); "
        "any but jax also times jax",
        choices=list(GDN_IMPLS),
    ),
)
SUBCOMMANDS = {
    "train-step": "the LoRA SFT step: tokens/s, FLOP/s, MFU against the measured matmul peak",
    "gdn": "the chunked gated delta rule alone, fwd and fwd+bwd, against transformers' torch function",
    "decode": "the embedded engine's decode tokens/s, time per decode step and bandwidth fraction at several batch sizes (--vs vllm)",
    "compile": "compile time of the train step at several depths",
    "all": "every benchmark above in one run",
    "profile": "trace the jaxpi train step (or the decode loop) and sum op time by model part (jax.profiler)",
}
OUT_FLAG = Flag("--out", "out", "also write the JSON report to this file")
# Every sub-benchmark's config: its class and flags; the model benchmarks share configs/bench/.
SPECS = {
    name: ConfigSpec(
        RUN_CONFIGS[name],
        "bench",
        (
            *_model_flags(depth_list=name == "compile"),
            *(DECODE_FLAGS if name in ("decode", "all") else ()),
            *(GDN_FLAGS if name in ("gdn", "all") else ()),
            *((Flag("--compile-layers", "compile_layers"),) if name == "all" else ()),
            *(PROFILE_FLAGS if name == "profile" else ()),
            OUT_FLAG,
        ),
    )
    for name in SUBCOMMANDS
}
SPECS["fleet"] = ConfigSpec(
    FleetRunConfig,
    "bench-fleet",
    (
        Flag("--workers", "workers", "fleet sizes, comma-separated (default 1,2,4)", type=_counts),
        Flag("--collections", "collections", "timed collections per size"),
        Flag("--ray-address", "ray_address", "a running Ray cluster (default: one started per size)"),
        OUT_FLAG,
    ),
)
SPECS["serve"] = ConfigSpec(
    RUN_CONFIGS["serve"],
    "bench-serve",
    (
        Flag("--out", "out", "where the checkpoint and records go (default: a temp dir)"),
        Flag("--requests", "requests", "concurrent completions (and engine rows)"),
        Flag("--repeats", "repeats"),
    ),
)


def add_subparser(sub: Any) -> None:
    """Register `jaxpi bench`."""
    bench = sub.add_parser(
        "bench",
        help=help_for("bench"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inner = bench.add_subparsers(dest="bench_command", required=True)
    for name, text in SUBCOMMANDS.items():
        p = add_command_parser(inner, name, help=text, description=text)
        add_config_arguments(p, SPECS[name])
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(fn=cmd_bench)
    p = add_command_parser(
        inner,
        "serve",
        help=serve_bench.HELP,
        description=serve_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p, SPECS["serve"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_serve)
    p = add_command_parser(
        inner,
        "fleet",
        help="GRPO collections per minute on a Ray fleet of 1, 2, 4, ... rollout workers",
        description=FLEET_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p, SPECS["fleet"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_fleet)
    # The accelerator run keeps flags of its own (a script's, not config keys: jaxpi.bench.gpu_flags).
    p = inner.add_parser(
        "gpu",
        help=gpu_flags.HELP,
        description=gpu_flags.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gpu_flags.add_arguments(p)
    p.set_defaults(fn=cmd_gpu)


def _limit_threads(n: int) -> None:
    """Run on the first n CPUs of this process's set: XLA's and torch's pools follow the mask
    (set before the JAX backend starts to size XLA's pool by it)."""
    cpus = sorted(os.sched_getaffinity(0))
    if 0 < n < len(cpus):
        os.sched_setaffinity(0, cpus[:n])


def cmd_bench(args: argparse.Namespace) -> int:
    cfg: BenchRunConfig = build_config(args)
    if cfg.threads:
        _limit_threads(cfg.threads)
    bench = cfg.bench_config()  # after _limit_threads: the threads XLA and torch actually get
    report = run(args.bench_command, bench, cfg)  # type: ignore[arg-type]  # the sub-benchmark's fields
    if cfg.out:
        write_text(Path(cfg.out), json.dumps(report, indent=2) + "\n")
    emit(report, args.json, "" if args.json else format_table(report))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`jaxpi bench serve`: the serving latencies, in a temporary directory unless `out` is set."""
    cfg = build_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(cfg.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        res = serve_bench.run(out, cfg.requests, cfg.repeats)
    emit(res, args.json, "\n".join(f"{k:40s} {v}" for k, v in res.items()))
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    """`jaxpi bench fleet`: attempts per minute against the number of rollout workers."""
    from jaxpi.bench.fleet import run as run_fleet  # jax, the trainer, Ray: only when it runs
    from jaxpi.bench.fleet import table

    cfg: FleetRunConfig = build_config(args)
    report = run_fleet(cfg)
    if cfg.out:
        write_text(Path(cfg.out), json.dumps(report, indent=2) + "\n")
    emit(report, args.json, table(report))
    return 0


def cmd_gpu(args: argparse.Namespace) -> int:
    """`jaxpi bench gpu`: the 27B-shaped run on one accelerator (`jaxpi.bench.gpu`)."""
    from jaxpi.bench.gpu import run as run_gpu  # jax, the model, the Pallas kernels: only when it runs

    return run_gpu(args)
