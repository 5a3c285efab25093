"""`jaxpi parity`: logits, loss and every gradient against transformers (float64 reference)."""

from __future__ import annotations

import argparse
from typing import Any

from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.kernels.inject import KNOWN_BUGS


def add_subparser(sub: Any) -> None:
    """Register `jaxpi parity`."""
    par = sub.add_parser("parity", help=help_for("parity"))
    par.add_argument(
        "--hf-dir", required=True, help="HF checkpoint directory (CausalLM or ConditionalGeneration)"
    )
    par.add_argument("--seq-len", type=int, default=64)
    par.add_argument("--batch", type=int, default=2)
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument("--seed", type=int, default=0)
    par.add_argument(
        "--reference",
        choices=["auto", "fp64", "fp32"],
        default="auto",
        help="what the errors are measured against: transformers in float64 (auto: where it fits in "
        "memory) or transformers' own run of --dtype",
    )
    par.add_argument(
        "--segments",
        type=int,
        default=1,
        help="pack each row with this many sequences of random lengths (transformers runs each alone)",
    )
    par.add_argument(
        "--inject",
        choices=sorted(KNOWN_BUGS),
        default=None,
        help="swap in a known-bad backward (norms, conv, DeltaNet); the harness must fail and name the "
        "parameters (segment-reset-off-by-one needs --segments 2 or more)",
    )
    par.add_argument(
        "--base-quant",
        choices=["none", "nf4", "int8"],
        default="none",
        help="quantize the frozen base (QLoRA) and compare logits, loss and every LoRA gradient with "
        "peft + bitsandbytes (CPU); float64 arbiter on the dequantized base",
    )
    par.add_argument("--rank", type=int, default=4, help="LoRA rank of the --base-quant comparison")
    par.add_argument("--top", type=int, default=15, help="gradient rows shown in the table")
    par.add_argument("--json", action="store_true", help="print one JSON object")
    par.set_defaults(fn=cmd_parity)


def cmd_parity(args: argparse.Namespace) -> int:
    common = dict(
        seq_len=args.seq_len,
        batch=args.batch,
        dtype=args.dtype,
        seed=args.seed,
        inject=args.inject,
        reference=args.reference,
        segments=args.segments,
    )
    if args.base_quant != "none":
        from jaxpi.parity_qlora import run_qlora_parity

        report = run_qlora_parity(args.hf_dir, base_quant=args.base_quant, rank=args.rank, **common)
    else:
        from jaxpi.parity import run_parity

        report = run_parity(args.hf_dir, **common)
    emit(report.to_json(), args.json, report.table(args.top))
    return 0 if report.passed else 1
