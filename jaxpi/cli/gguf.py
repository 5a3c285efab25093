"""`jaxpi gguf setup|ppl` and `jaxpi imatrix`: llama.cpp for the GGUF export, built once into a
cache; perplexity of GGUF files on held-out sessions; the importance matrix from agent sessions.

    jaxpi gguf setup [--dir DIR] [--force] [--json]
    jaxpi gguf ppl --gguf FILE [--gguf FILE ...] [--lora FILE] --sessions DIR --tokenizer HF_DIR [--ctx N] [--json]
    jaxpi imatrix --model HF_DIR --sessions DIR --out FILE [--ctx N] [--heldout F] [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi gguf` and `jaxpi imatrix`."""
    g = sub.add_parser("gguf", help=help_for("gguf"), description=help_for("gguf"))
    gs = g.add_subparsers(dest="gguf_command", required=True)
    s = gs.add_parser(
        "setup",
        help="build llama.cpp (quantize, imatrix, perplexity tools and libllama) from the llama-cpp-python "
        "sdist on PyPI into ~/.cache/jaxpi (once per machine, ~3 min on 2 cores)",
    )
    s.add_argument(
        "--dir", default=None, help="where (default $JAXPI_LLAMACPP_DIR or ~/.cache/jaxpi/llama.cpp-VERSION)"
    )
    s.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=cmd_setup)
    p = gs.add_parser(
        "ppl",
        help="teacher-forced perplexity of GGUF files in llama.cpp on sessions (each window from a fresh state)",
    )
    p.add_argument("--gguf", action="append", required=True, help="a GGUF file (repeat for several)")
    p.add_argument("--lora", default=None, help="a llama.cpp LoRA GGUF applied to every --gguf")
    p.add_argument("--sessions", required=True, help="Pi sessions (directory or .jsonl files)")
    p.add_argument(
        "--tokenizer", required=True, help="the HF checkpoint directory whose chat template renders them"
    )
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_ppl)

    im = sub.add_parser("imatrix", help=help_for("imatrix"), description=help_for("imatrix"))
    im.add_argument("--model", required=True, help="HF checkpoint directory (the merged fine-tuned model)")
    im.add_argument(
        "--sessions", required=True, help="Pi sessions (directory or .jsonl files), failures included"
    )
    im.add_argument("--out", required=True, help="the importance matrix file (GGUF), written atomically")
    im.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    im.add_argument(
        "--heldout",
        type=float,
        default=0.0,
        help="share of tasks left out of the statistics (default 0: none)",
    )
    im.add_argument("--seed", type=int, default=0, help="seed of the task split")
    im.add_argument("--json", action="store_true", help="print one JSON object")
    im.set_defaults(fn=cmd_imatrix)


def _log(as_json: bool) -> Any:
    return (lambda m: None) if as_json else (lambda m: print(m, file=sys.stderr, flush=True))


def cmd_setup(args: argparse.Namespace) -> int:
    from jaxpi.llamacpp.setup import build

    summary = build(Path(args.dir) if args.dir else None, force=args.force, log=_log(args.json))
    emit(summary, args.json, f"llama.cpp ready at {summary['dir']}")
    return 0


def cmd_ppl(args: argparse.Namespace) -> int:
    from jaxpi.convert.gguf_export import perplexity
    from jaxpi.convert.imatrix import load_calibration, windows
    from jaxpi.llamacpp.runtime import find

    lc = find()
    seqs, _, info = load_calibration(args.sessions, args.tokenizer, heldout=0.0)
    wins = [w for s in seqs for w in windows(s.ids, args.ctx)]
    rows = []
    for f in args.gguf:
        r = perplexity(lc, Path(f), wins, lora=None if args.lora is None else Path(args.lora))
        rows.append({"gguf": f, **r})
    lines = [f"{len(wins)} windows of {info['sessions']} sessions; perplexity in llama.cpp"]
    lines += [f"  {r['gguf']}: {r['ppl']:.4f} ({r['tokens']} tokens)" for r in rows]
    emit({"windows": len(wins), "sessions": info["sessions"], "rows": rows}, args.json, "\n".join(lines))
    return 0


def cmd_imatrix(args: argparse.Namespace) -> int:
    from jaxpi.convert.imatrix import collect, load_calibration, save_imatrix

    log = _log(args.json)
    out = Path(args.out)
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory; --out names the imatrix file")
    calib, _, info = load_calibration(args.sessions, args.model, heldout=args.heldout, seed=args.seed)
    log(
        f"{info['sessions']} sessions ({info['verified']} verified, {info['failed']} failed, {info['rejected']} "
        f"unreadable); {len(info['calibration_tasks'])} tasks calibrate, {len(info['heldout_tasks'])} held out"
    )
    stats = collect(args.model, calib, ctx=args.ctx, progress=log)
    save_imatrix(out, stats, datasets=[str(args.sessions)], ctx=args.ctx)
    summary = {"out": str(out), "windows": stats.chunks, "tensors": len(stats.sums), "ctx": args.ctx, **info}
    emit(
        summary,
        args.json,
        f"wrote {out} ({len(stats.sums)} weights, {stats.chunks} windows of <= {args.ctx} tokens)",
    )
    return 0
