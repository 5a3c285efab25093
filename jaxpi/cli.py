"""`jaxpi`: the command-line front door.

jaxpi parity --hf-dir DIR [--seq-len N] [--batch B] [--dtype float32|bfloat16] [--inject BUG] [--json]
jaxpi convert --from DIR --to OUT [--dtype bfloat16] [--max-shard-size 5GB] [--check] [--json]
jaxpi tiny-checkpoint OUT [--kind causal|conditional] [--layers N] [--seed S] [--dtype float32]
jaxpi demo [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit]
    return int(float(m.group(1)) * scale)


def _print(obj: dict, as_json: bool, text: str) -> None:
    print(json.dumps(obj, indent=2) if as_json else text)


def cmd_parity(args: argparse.Namespace) -> int:
    from jaxpi.parity import run_parity

    report = run_parity(
        args.hf_dir,
        seq_len=args.seq_len,
        batch=args.batch,
        dtype=args.dtype,
        seed=args.seed,
        inject=args.inject,
    )
    _print(report.to_json(), args.json, report.table(args.top))
    return 0 if report.passed else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxpi.config import QwenConfig
    from jaxpi.convert.hf import check_checkpoint, load_hf, save_hf
    from jaxpi.convert.safetensors_io import read_index

    src = Path(args.src)
    cfg = QwenConfig.from_hf(src)
    index = read_index(src)
    rules, carried = check_checkpoint(cfg, index)
    summary = {
        "source": str(src),
        "layers": cfg.num_hidden_layers,
        "layer_types": {t: cfg.layer_types.count(t) for t in sorted(set(cfg.layer_types))},
        "text_tensors": len(rules),
        "carried_tensors": len(carried),
        "dtypes": sorted({index[r.hf].dtype for r in rules}),
    }
    if args.check or args.dst is None:
        _print(summary, args.json, "\n".join(f"{k}: {v}" for k, v in summary.items()) + "\ncheckpoint OK")
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
    _print(summary, args.json, f"wrote {out} ({len(files)} files)")
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import make_checkpoint

    cfg = TINY.replace(num_hidden_layers=args.layers, tie_word_embeddings=args.tied)
    out = make_checkpoint(args.out, cfg, kind=args.kind, seed=args.seed, dtype=args.dtype)
    print(out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Tiny random Qwen3.5 checkpoint (transformers) → jaxpi → parity table."""
    import jax
    from flax import nnx

    from jaxpi.config import TINY
    from jaxpi.convert.hf import load_hf
    from jaxpi.hf_fixtures import make_checkpoint
    from jaxpi.parity import run_parity

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="jaxpi-demo-"))
    ckpt = root / "tiny-qwen3_5"
    if not (ckpt / "config.json").exists():
        cfg = TINY.replace(num_hidden_layers=8)
        make_checkpoint(ckpt, cfg, kind="conditional", seed=args.seed)
    cfg, model = load_hf(ckpt)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not args.json:
        print(
            f"checkpoint: {ckpt}\nmodel: {cfg.num_hidden_layers} layers {cfg.layer_types}, {n_params:,} params"
        )
    report = run_parity(ckpt, seq_len=args.seq_len, batch=2, seed=args.seed)
    _print(report.to_json(), args.json, report.table())
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpi", description="Qwen3.5 in JAX: HF weights in and out, parity with transformers."
    )
    sub = p.add_subparsers(dest="command", required=True)

    par = sub.add_parser("parity", help="compare logits, loss and every gradient against transformers")
    par.add_argument(
        "--hf-dir", required=True, help="HF checkpoint directory (CausalLM or ConditionalGeneration)"
    )
    par.add_argument("--seq-len", type=int, default=64)
    par.add_argument("--batch", type=int, default=2)
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument("--seed", type=int, default=0)
    from jaxpi.kernels.norms import KNOWN_BUGS

    par.add_argument(
        "--inject",
        choices=sorted(KNOWN_BUGS),
        default=None,
        help="swap in a known-bad fused-norm backward; the harness must fail and name the parameters",
    )
    par.add_argument("--top", type=int, default=15, help="gradient rows shown in the table")
    par.add_argument("--json", action="store_true", help="print one JSON object")
    par.set_defaults(fn=cmd_parity)

    conv = sub.add_parser(
        "convert",
        help="check a HF checkpoint, or re-export it through jaxpi (dtype, shard size)",
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
    conv.add_argument("--max-shard-size", type=_size, default=5 * 1024**3, help="e.g. 5GB (default), 500MB")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    conv.add_argument("--check", action="store_true", help="only validate the source")
    conv.add_argument("--json", action="store_true")
    conv.set_defaults(fn=cmd_convert)

    tiny = sub.add_parser("tiny-checkpoint", help="write a tiny random Qwen3.5 checkpoint with transformers")
    tiny.add_argument("out")
    tiny.add_argument("--kind", choices=["causal", "conditional"], default="causal")
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--tied", action="store_true", help="tie_word_embeddings")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tiny.set_defaults(fn=cmd_tiny)

    demo = sub.add_parser("demo", help="tiny checkpoint -> jaxpi -> parity table (what `make demo` runs)")
    demo.add_argument("--out", default=None, help="where to keep the tiny checkpoint (default: a temp dir)")
    demo.add_argument("--seq-len", type=int, default=48)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"jaxpi {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
