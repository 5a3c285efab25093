"""`jaxpi plan`: memory per device and collectives of a sharded step, compiled for N virtual devices."""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxpi.cli.options import size
from jaxpi.cli.registry import help_for
from jaxpi.config import ATTN_IMPLS, GDN_IMPLS, REMAT_POLICIES
from jaxpi.plan.presets import load_preset


def add_subparser(sub: Any) -> None:
    """Register `jaxpi plan`."""
    pl = sub.add_parser(
        "plan",
        help=help_for("plan"),
        description="Build the training step with abstract arrays only, compile it for the mesh (as N virtual "
        "CPU devices), and report per device: parameter, trainable and optimizer bytes, temporaries, peak, and "
        "the collectives per step, each next to an analytic estimate. Nothing is allocated.",
    )
    pl.add_argument("--model", default="qwen3_5_27b", help="model preset (qwen3_5_27b, tiny)")
    pl.add_argument("--mesh", default=None, help="e.g. fsdp=64 or data=2,fsdp=4,tensor=2")
    pl.add_argument("--dcn", default=None, help="the part of each axis across slices/hosts, e.g. data=2")
    pl.add_argument("--preset", default=None, help="configs/sharding/NAME.yaml: mesh, dcn, device memory")
    pl.add_argument("--strategy", default=None, help="dp, fsdp, tp, fsdp_tp (default fsdp)")
    pl.add_argument("--compare", default=None, help="comma-separated strategies, one column each")
    pl.add_argument("--seq-len", type=int, default=8192)
    pl.add_argument("--batch-per-device", type=int, default=1)
    pl.add_argument(
        "--lora-rank", type=int, default=None, help="LoRA on all linear layers (default: full FT)"
    )
    pl.add_argument(
        "--device-memory", type=size, default=None, help="e.g. 95GiB; exit 1 when it does not fit"
    )
    pl.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    pl.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default="full",
        help="what each layer group saves for the backward (mlp: its MLP gate/up outputs; mlp_out: "
        "those and each layer's output)",
    )
    pl.add_argument(
        "--loss-chunk", type=int, default=0, help="LM head this many positions at a time (0: all at once)"
    )
    pl.add_argument(
        "--attn-impl",
        choices=ATTN_IMPLS,
        default="jax",
        help="model.attn_impl: jax keeps each query block's scores for the backward, pallas (flash) "
        "only a log-sum-exp per query (on CPU the kernel compiles in Pallas' interpreter)",
    )
    pl.add_argument(
        "--gdn-impl",
        choices=GDN_IMPLS,
        default="jax",
        help="model.gdn_impl, compiled as given (the analytic figure counts every impl as the plain scan)",
    )
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)


def _plan_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill --mesh / --device-memory / --dcn / --strategy from --preset where not given."""
    if args.preset:
        p = load_preset(args.preset)
        args.mesh = args.mesh or p["mesh"]
        args.dcn = args.dcn or p.get("dcn")
        if args.device_memory is None and p.get("device_memory"):
            args.device_memory = size(str(p["device_memory"]))
        if not args.strategy and not args.compare:
            args.strategy = p.get("strategy")
    if not args.mesh:
        raise ValueError("give --mesh (e.g. fsdp=64) or --preset")
    return args


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxpi.plan import PlanRequest, format_table, plan

    args = _plan_args(args)
    names = args.compare.split(",") if args.compare else [args.strategy or "fsdp"]
    results = []
    for name in names:
        req = PlanRequest(
            model=args.model,
            mesh=args.mesh,
            strategy=name.strip(),
            seq_len=args.seq_len,
            batch_per_device=args.batch_per_device,
            lora_rank=args.lora_rank,
            device_memory=args.device_memory,
            dtype=args.dtype,
            remat=args.remat,
            dcn=args.dcn,
            loss_chunk=args.loss_chunk,
            attn_impl=args.attn_impl,
            gdn_impl=args.gdn_impl,
        )
        results.append(plan(req, progress=not args.json))
    if args.json:
        print(json.dumps([r.to_json() for r in results] if args.compare else results[0].to_json(), indent=2))
    else:
        print(format_table(results))
    return 0 if all(r.fits is not False for r in results) else 1
