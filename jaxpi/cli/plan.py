"""`jaxpi plan`: memory per device and collectives of a sharded step, compiled for N virtual devices."""

from __future__ import annotations

import argparse
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.options import size
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.config import ATTN_IMPLS, GDN_IMPLS, REMAT_POLICIES
from jaxpi.plan.config import DTYPES, PlanConfig
from jaxpi.plan.presets import prepare_plan_process

SPEC = ConfigSpec(
    PlanConfig,
    "plan",
    (
        Flag("--model", "model", "model preset (qwen3_5_27b, qwen3_5_9b, tiny, qwen3_8b, qwen3_tiny)"),
        Flag("--mesh", "mesh", "e.g. fsdp=64 or data=2,fsdp=4,tensor=2"),
        Flag("--dcn", "dcn", "the part of each axis across slices/hosts, e.g. data=2"),
        Flag("--preset", "preset", "configs/sharding/NAME.yaml: mesh, dcn, device memory"),
        Flag("--strategy", "strategy", "dp, fsdp, tp, fsdp_tp (default fsdp)"),
        Flag("--compare", "compare", "comma-separated strategies, one column each"),
        Flag("--seq-len", "seq_len"),
        Flag("--batch-per-device", "batch_per_device"),
        Flag("--lora-rank", "lora_rank", "LoRA on all linear layers (default: full FT)"),
        Flag("--device-memory", "device_memory", "e.g. 95GiB; exit 1 when it does not fit", type=size),
        Flag("--dtype", "dtype", choices=list(DTYPES)),
        Flag(
            "--remat",
            "remat",
            "what each layer group saves for the backward (mlp: its MLP gate/up outputs; mlp_out: "
            "those and each layer's output)",
            choices=REMAT_POLICIES,
        ),
        Flag("--loss-chunk", "loss_chunk", "LM head this many positions at a time (0: all at once)"),
        Flag(
            "--attn-impl",
            "attn_impl",
            "model.attn_impl: jax keeps each query block's scores for the backward, pallas (flash) "
            "only a log-sum-exp per query (on CPU the kernel compiles in Pallas' interpreter)",
            choices=ATTN_IMPLS,
        ),
        Flag(
            "--gdn-impl",
            "gdn_impl",
            "model.gdn_impl, compiled as given (the analytic figure counts every impl as the plain scan)",
            choices=GDN_IMPLS,
        ),
        Flag(
            "--base-quant",
            "base_quant",
            "the frozen base: none (the dtype), nf4 (QLoRA: 4-bit NormalFloat, double-quantized "
            "scales) or int8; needs --lora-rank",
            choices=["none", "nf4", "int8"],
        ),
        Flag(
            "--no-compile",
            "no_compile",
            "the analytic figures only, in seconds: no XLA compile, the verdict from the analytic peak",
        ),
    ),
)


def add_subparser(sub: Any) -> None:
    """Register `jaxpi plan`."""
    pl = add_command_parser(
        sub,
        "plan",
        help=help_for("plan"),
        description="Build the training step with abstract arrays only, compile it for the mesh (as N virtual "
        "CPU devices), and report per device: parameter, trainable and optimizer bytes, temporaries, peak, and "
        "the collectives per step, each next to an analytic estimate. Nothing is allocated.",
    )
    add_config_arguments(pl, SPEC)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    cfg: PlanConfig = build_config(args)  # the preset fills --mesh / --dcn / --device-memory / --strategy
    if cfg.devices is not None:
        prepare_plan_process(cfg.devices)  # before jax starts its backend
    from jaxpi.plan import PlanRequest, format_table, plan

    results = [
        plan(PlanRequest(**cfg.request_fields(name)), progress=not args.json) for name in cfg.strategies
    ]
    emit(
        [r.to_json() for r in results] if cfg.compare else results[0].to_json(),
        args.json,
        format_table(results),
    )
    return 0 if all(r.fits is not False for r in results) else 1
