"""`jaxpi convert`: check a HF checkpoint, or write it back out through jaxpi."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxpi.cli.options import size
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi convert`."""
    conv = sub.add_parser(
        "convert",
        help=help_for("convert"),
        description="Validate a HF Qwen3.5 checkpoint against its config (names, shapes, dtypes), and with "
        "--to write it back out through jaxpi: HF layout, <= --max-shard-size shards + index, tokenizer "
        "files copied, vision/MTP tensors carried byte for byte, written atomically.",
    )
    conv.add_argument("--from", dest="src", required=True, help="source HF checkpoint directory")
    conv.add_argument("--to", dest="dst", default=None, help="output directory (omit to only check)")
    conv.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the written text tensors (default: the source's)",
    )
    conv.add_argument("--load-dtype", choices=["float32", "bfloat16"], default="float32")
    conv.add_argument("--max-shard-size", type=size, default=5 * 1024**3, help="e.g. 5GB (default), 500MB")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    conv.add_argument("--check", action="store_true", help="only validate the source")
    conv.add_argument("--json", action="store_true")
    conv.set_defaults(fn=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxpi.convert.hf import check_dir, load_hf, save_hf

    src = Path(args.src)
    only_check = args.check or args.dst is None
    # config.json, index and headers always; the NaN/Inf scan reads every weight, so only for --check
    summary = check_dir(src, scan=only_check, progress=not args.json)
    if only_check:
        emit(summary, args.json, "\n".join(f"{k}: {v}" for k, v in summary.items()) + "\ncheckpoint OK")
        return 0
    _, model = load_hf(src, dtype=args.load_dtype, progress=not args.json)
    out = save_hf(
        model,
        args.dst,
        source=src,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.json,
    )
    files = sorted(p.name for p in out.iterdir())
    summary.update(output=str(out), files=files)
    emit(summary, args.json, f"wrote {out} ({len(files)} files)")
    return 0
