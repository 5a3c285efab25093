"""`jaxpi export`: a trained adapter out as a peft LoRA adapter, or merged into a full HF checkpoint.

    jaxpi export --adapter CKPT --base HF_DIR --out DIR [--merged] [--dtype D] [--json]

CKPT is a peft adapter directory (it has `adapter_config.json`) or a jaxpi trainer checkpoint
(a run directory, its `checkpoints/` directory or one step), read by
`jaxpi.train.checkpoint.load_adapter`; for those, `--base` defaults to the base recorded in the
checkpoint. The peft export needs only the base's `config.json` (no weights are loaded); the
merged export loads the base, folds the adapter in and writes it with `save_hf` (`export()`, in
`jaxpi.train.export`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxpi.cli.registry import help_for
from jaxpi.train.export import DTYPES, export


def add_subparser(sub: Any) -> None:
    """Register `export` on the `jaxpi` command's subparsers."""
    ex = sub.add_parser(
        "export",
        help=help_for("export"),
        description="Export a LoRA adapter (a peft adapter directory or a jaxpi trainer checkpoint) for the "
        "HF base checkpoint --base: a peft adapter whose tensor names match the base's architecture "
        "(peft and vLLM load it), or with --merged a full HF checkpoint of base + adapter. Written atomically.",
    )
    ex.add_argument("--adapter", required=True, help="peft adapter directory or jaxpi trainer checkpoint")
    ex.add_argument("--base", default=None, help="HF base checkpoint directory (default: the checkpoint's)")
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument("--merged", action="store_true", help="write base + adapter as a full HF checkpoint")
    ex.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="stored dtype (default: float32 for an adapter, the base's dtypes for --merged)",
    )
    ex.add_argument("--base-name", default=None, help="base_model_name_or_path to record (default: --base)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.set_defaults(fn=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    summary = export(
        args.adapter,
        args.out,
        base=args.base,
        merged=args.merged,
        dtype=args.dtype,
        base_name=args.base_name,
        overwrite=args.overwrite,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        what = "merged checkpoint" if args.merged else "peft adapter"
        print(
            f"wrote {what} {summary['output']} ({summary['modules']} adapted modules, r={summary['rank']}, "
            f"from {summary['source']} {summary['adapter']})"
        )
    return 0
