"""`jaxpi export`: a trained adapter out as a peft LoRA adapter, merged into a full HF checkpoint,
merged and stored as block-wise FP8 or as GGUF files; the adapter as a llama.cpp LoRA GGUF; or a
HF checkpoint on its own as FP8 or GGUF.

    jaxpi export --adapter CKPT --base HF_DIR --out DIR [--merged | --format fp8] [--dtype D] [--json]
    jaxpi export --format fp8 --base HF_DIR --out DIR [--json]
    jaxpi export --format fp8 --size-of qwen3_5_27b [--json]      # the export's size, no weights
    jaxpi export --format gguf --base HF_DIR --out DIR --quant Q8_0,Q4_K_M [--sessions DIR [--report]]
    jaxpi export --format gguf --adapter CKPT [--merged] --out DIR ...   # LoRA GGUF, or merged GGUFs

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
import sys
from pathlib import Path
from typing import Any

from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.train.export import DTYPES, FORMATS, export


def add_subparser(sub: Any) -> None:
    """Register `export` on the `jaxpi` command's subparsers."""
    ex = sub.add_parser(
        "export",
        help=help_for("export"),
        description="Export a LoRA adapter (a peft adapter directory or a jaxpi trainer checkpoint) for the "
        "HF base checkpoint --base: a peft adapter whose tensor names match the base's architecture "
        "(peft and vLLM load it), with --merged a full HF checkpoint of base + adapter, or with --format fp8 "
        "that checkpoint (or --base alone) in block-wise FP8 as Qwen's FP8 releases store it, with --format gguf "
        "llama.cpp GGUF files (the base written by jaxpi, the variants by llama.cpp's quantizer) or, for an "
        "adapter without --merged, a llama.cpp LoRA GGUF. Written atomically.",
    )
    ex.add_argument(
        "--adapter",
        default=None,
        help="peft adapter directory or jaxpi trainer checkpoint (required but for --format fp8, "
        "which without it converts --base itself)",
    )
    ex.add_argument("--base", default=None, help="HF base checkpoint directory (default: the checkpoint's)")
    ex.add_argument("--out", default=None, help="output directory")
    ex.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="peft (default): the adapter; merged: base + adapter as a full HF checkpoint; fp8: the merged "
        "checkpoint (or --base alone) with its linear weights in block-wise FP8 E4M3, 128x128 blocks; gguf: "
        "llama.cpp files (docs/export.md)",
    )
    ex.add_argument(
        "--merged",
        action="store_true",
        help="the same as --format merged; with --format gguf: merge, then GGUF",
    )
    g = ex.add_argument_group("GGUF (--format gguf; llama.cpp from `jaxpi gguf setup`)")
    g.add_argument(
        "--quant",
        default=None,
        help="comma-separated llama-quantize types, or 'all' (the 17 from Q8_0 to IQ2_XXS); BF16 keeps the "
        "base file (default: Q8_0,Q4_K_M)",
    )
    g.add_argument(
        "--imatrix", default=None, help="an importance matrix (GGUF, from `jaxpi imatrix` or llama-imatrix)"
    )
    g.add_argument(
        "--sessions",
        default=None,
        help="Pi sessions (directory or .jsonl): without --imatrix, the importance matrix is computed from them; "
        "with --report, a task-disjoint share is held out and scored",
    )
    g.add_argument(
        "--heldout", type=float, default=0.2, help="share of tasks held out with --report (default 0.2)"
    )
    g.add_argument(
        "--ctx", type=int, default=512, help="tokens per calibration / scoring window (default 512)"
    )
    g.add_argument(
        "--report",
        action="store_true",
        help="perplexity of every file on the held-out sessions, in llama.cpp",
    )
    ex.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="stored dtype (default: float32 for an adapter, the base's dtypes for --merged; for fp8 the "
        "dtype of the tensors it keeps unquantized)",
    )
    ex.add_argument(
        "--size-of",
        default=None,
        metavar="MODEL",
        help="with --format fp8: print the export's size for a preset (qwen3_5_27b, qwen3_5_9b, tiny: with the "
        "vision tower and MTP head they ship) or a checkpoint's config.json, and write nothing",
    )
    ex.add_argument(
        "--base-quant",
        choices=["none", "nf4", "int8"],
        default=None,
        help="the base the adapter was trained on (default: a jaxpi checkpoint's lora.base_quant, none for a "
        "peft adapter); a merged export of an nf4/int8 adapter merges into that base dequantized, in BF16",
    )
    ex.add_argument("--base-name", default=None, help="base_model_name_or_path to record (default: --base)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.set_defaults(fn=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    fmt = args.format or ("merged" if args.merged else "peft")
    if args.merged and fmt not in ("merged", "gguf"):
        raise ValueError(f"--merged and --format {fmt} disagree: give one of them")
    if fmt == "gguf":
        return _gguf(args)
    if args.size_of is not None:
        if fmt != "fp8":
            raise ValueError("--size-of reports the fp8 export's size: give --format fp8")
        return _size_of(args.size_of, args.json)
    if args.out is None:
        raise ValueError("--out is required (the output directory)")
    summary = export(
        args.adapter,
        args.out,
        base=args.base,
        fmt=fmt,
        dtype=args.dtype,
        base_name=args.base_name,
        overwrite=args.overwrite,
        progress=not args.json,
        base_quant=args.base_quant,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    elif fmt == "fp8":
        if summary["ragged"]:
            print(
                f"note: {len(summary['ragged'])} weights end in a partial 128x128 block (e.g. {summary['ragged'][0]}): "
                "vLLM reads them; transformers' CPU dequantization (5.24) mis-scales them",
                file=sys.stderr,
            )
        print(
            f"wrote FP8 checkpoint {summary['output']} ({summary['quantized_tensors']} linear weights in "
            f"{summary['block'][0]}x{summary['block'][1]} E4M3 blocks, {summary['kept_tensors']} tensors kept; "
            f"{_gb(summary['bytes'])} from {_gb(summary['source_bytes'])})"
        )
    else:
        what = "merged checkpoint" if fmt == "merged" else "peft adapter"
        print(
            f"wrote {what} {summary['output']} ({summary['modules']} adapted modules, r={summary['rank']}, "
            f"from {summary['source']} {summary['adapter']})"
        )
    return 0


_GGUF_DTYPES = {None: "BF16", "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _gguf(args: argparse.Namespace) -> int:
    if args.out is None:
        raise ValueError("--out is required (the output directory)")
    given = (
        ("--quant", args.quant is not None),
        ("--imatrix", args.imatrix is not None),
        ("--sessions", args.sessions is not None),
        ("--report", args.report),
    )
    gguf_only = [flag for flag, set_ in given if set_]
    options: dict[str, Any] = {}
    if args.adapter is None or args.merged:
        options = {
            "quants": "Q8_0,Q4_K_M" if args.quant is None else args.quant, "dtype": _GGUF_DTYPES[args.dtype], "imatrix": args.imatrix,
            "sessions": args.sessions, "heldout": args.heldout, "ctx": args.ctx, "report": args.report,
        }  # fmt: skip
    elif gguf_only:
        raise ValueError(
            f"{', '.join(gguf_only)}: for the model's GGUF files; add --merged (the adapter GGUF is its LoRA factors)"
        )
    summary = export(
        args.adapter, args.out, base=args.base, fmt="gguf", merged=args.merged, overwrite=args.overwrite,
        progress=not args.json, gguf=options, base_quant=args.base_quant,
    )  # fmt: skip
    for w in summary["base"].get("warnings", []) if isinstance(summary.get("base"), dict) else []:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if summary["format"] == "gguf-lora":
        print(
            f"wrote llama.cpp LoRA {Path(summary['output']) / summary['file']} ({summary['modules']} modules, "
            f"r={summary['rank']}, alpha={summary['alpha']}; apply with --lora on a GGUF of the base)"
        )
        return 0
    print(f"wrote GGUF files to {summary['output']}:")
    if summary["base"]["kept"]:
        print(f"  {summary['base']['file']:<32}{_gb(summary['base']['bytes']):>12}")
    for f in summary["variants"].values():
        if f["file"] == summary["base"]["file"]:
            continue
        note = (
            f"  ({f['fallback_tensors']} tensors in a fallback type: rows not a multiple of 256)"
            if f.get("fallback_tensors")
            else ""
        )
        print(f"  {f['file']:<32}{_gb(f['bytes']):>12}{'  imatrix' if f['imatrix'] else ''}{note}")
    if "report" in summary:
        print((Path(summary["output"]) / "gguf_report.md").read_text(), end="")
    return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _size_of(model: str, as_json: bool) -> int:
    from jaxpi.config import PRESETS
    from jaxpi.convert.fp8 import VISION_DEFAULTS, fp8_size
    from jaxpi.convert.hf import read_config
    from jaxpi.convert.safetensors_io import CheckpointError, read_json

    if model in PRESETS:
        cfg, vision, mtp = (
            PRESETS[model],
            (None if model == "tiny" else dict(VISION_DEFAULTS)),
            model != "tiny",
        )
    else:
        path = Path(model)
        folder = path if path.is_dir() else path.parent
        if not (folder / "config.json").is_file() or (not path.is_dir() and path.name != "config.json"):
            raise FileNotFoundError(f"{model}: neither a preset ({', '.join(PRESETS)}) nor a config.json")
        cfg = read_config(folder)  # faults name the file
        raw = read_json(folder / "config.json", "config", limit=64 * 2**20)
        vision = raw.get("vision_config")
        if vision is not None and not isinstance(vision, dict):
            raise CheckpointError(f"{folder / 'config.json'}: vision_config is not an object")
        mtp = bool(raw.get("text_config", raw).get("mtp_num_hidden_layers"))
    report = {"model": model, **fp8_size(cfg, vision=vision, mtp=mtp)}
    lines = [
        f"{'part':<8}{'tensors':>9}{'params':>16}{'BF16':>12}{'FP8':>12}  (FP8: E4M3 weights + float32 scales)"
    ]
    for part, r in report["parts"].items():
        lines.append(
            f"{part:<8}{r['tensors']:>9}{r['params']:>16,}{_gb(r['bf16_bytes']):>12}{_gb(r['bytes']):>12}"
        )
    lines.append(
        f"{'total':<8}{report['tensors']:>9}{report['params']:>16,}{_gb(report['bf16_bytes']):>12}{_gb(report['bytes']):>12}"
    )
    emit(report, as_json, "\n".join(lines))
    return 0
